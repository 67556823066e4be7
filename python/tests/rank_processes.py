"""Runs one worker process per rank (the multi-process tests' gloo ranks) and
fails the test, with the rank's output, if any of them fails."""
import os
import subprocess


def _run_once(commands, timeout_s):
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
    return procs, logs


def run_ranks(commands, timeout_s, rendezvous=None):
    """Starts commands[r] (an argv list) for every rank r with OMP_NUM_THREADS=1,
    waits up to timeout_s for each, kills any still running, and asserts that
    every rank exited with status 0. Returns the ranks' combined output.

    A world in which a rank died of a signal (gloo's transport can abort a
    process as its connections close: "terminate called without an active
    exception") runs once more from a fresh rendezvous file (its other ranks
    may have failed because of it); a failure without a signal, or a second
    world with one, fails the test."""
    for attempt in range(2):
        if rendezvous is not None and os.path.exists(rendezvous):
            os.remove(rendezvous)
        procs, logs = _run_once(commands, timeout_s)
        signalled = [r for r, p in enumerate(procs) if p.returncode < 0]
        if not signalled or attempt == 1:
            break
        print(f"rank {signalled[0]} of {len(procs)} died of signal {-procs[signalled[0]].returncode}; "
              f"running the world again:\n{logs[signalled[0]]}")
    for r, (proc, log) in enumerate(zip(procs, logs)):
        assert proc.returncode == 0, f"rank {r} of {len(procs)} failed (exit {proc.returncode}):\n{log}"
    return logs
