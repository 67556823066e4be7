"""Runs one worker process per rank (the multi-process tests' gloo ranks) and
fails the test, with the rank's output, if any of them fails."""
import os
import subprocess


def run_ranks(commands, timeout_s):
    """Starts commands[r] (an argv list) for every rank r with OMP_NUM_THREADS=1,
    waits up to timeout_s for each, kills any still running, and asserts that
    every rank exited with status 0. Returns the ranks' combined output."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd in commands]
    logs = []
    try:
        for proc in procs:
            logs.append(proc.communicate(timeout=timeout_s)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for r, (proc, log) in enumerate(zip(procs, logs)):
        assert proc.returncode == 0, f"rank {r} of {len(procs)} failed (exit {proc.returncode}):\n{log}"
    return logs
