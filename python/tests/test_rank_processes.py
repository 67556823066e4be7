"""rank_processes.run_ranks: a world whose rank died of a signal runs once more;
a rank that fails by itself, or a second signal, fails the test."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from rank_processes import run_ranks  # noqa: E402

# Aborts (SIGABRT) the first time it runs (no marker yet), then exits 0.
ABORT_ONCE = "import os, sys; m = sys.argv[1]\nif not os.path.exists(m):\n    open(m, 'w').close(); os.abort()\n"


def test_a_rank_killed_by_a_signal_runs_the_world_again(tmp_path):
    rendezvous = tmp_path / "rendezvous"
    rendezvous.write_text("stale")  # removed before each world
    marker = tmp_path / "marker"
    logs = run_ranks([[sys.executable, "-c", ABORT_ONCE, str(marker)], [sys.executable, "-c", "print('ok')"]], 60,
                     rendezvous=str(rendezvous))
    assert marker.exists() and logs[1].strip() == "ok" and not rendezvous.exists()


def test_a_second_signal_fails():
    with pytest.raises(AssertionError, match=r"rank 0 of 2 failed \(exit -6\)"):
        run_ranks([[sys.executable, "-c", "import os; os.abort()"], [sys.executable, "-c", "pass"]], 60)


def test_a_rank_failing_by_itself_is_not_run_again(tmp_path):
    count = tmp_path / "count"
    script = f"open({str(count)!r}, 'a').write('x'); raise SystemExit(1)"
    with pytest.raises(AssertionError, match=r"rank 1 of 2 failed \(exit 1\)"):
        run_ranks([[sys.executable, "-c", "pass"], [sys.executable, "-c", script]], 60)
    assert count.read_text() == "x"
