"""benchmarks/peers_rss.py: a child's own peak memory, its memory at the end of its training steps, the timeout,
and a stop (Ctrl-C, SIGTERM) that takes the child's whole process group with it."""

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import load_benchmark

peers = load_benchmark("peers")
rss = peers.rss
TOUCH_300_MIB = "import time; data = b'x' * (300 * 2**20); print('done'); time.sleep(0.5); raise SystemExit(3)"


@pytest.mark.slow
def test_a_childs_peak_rss_is_its_own(tmp_path):
    child = rss.run_child([sys.executable, "-c", TOUCH_300_MIB], tmp_path / "a.log", 60, tmp_path)
    assert (child.code, child.output, child.train_kib) == (3, "done\n", None)
    assert 300 * 1024 <= child.peak_kib < 400 * 1024  # the child's own peak, in KiB
    # A launcher with a larger peak than the child's: wait4 would report the launcher's, the child's is kept.
    ballast = bytearray(os.urandom(1)) * (700 * 2**20)
    child = rss.run_child([sys.executable, "-c", TOUCH_300_MIB], tmp_path / "b.log", 60, tmp_path)
    assert child.code == 3 and 300 * 1024 <= child.peak_kib < 400 * 1024 and len(ballast) == 700 * 2**20
    del ballast


@pytest.mark.slow
def test_the_train_rss_is_the_peak_when_the_files_show_the_training_steps(tmp_path):
    # the first step is written, then 300 MiB touched as a final evaluation would, then the second step
    script = ("import sys, time; open('steps', 'a').write('step\\n'); time.sleep(1); data = b'x' * (300 * 2**20); "
              "open('steps', 'a').write('step\\n')")
    steps = tmp_path / "steps"
    child = rss.run_child([sys.executable, "-c", script], tmp_path / "c.log", 60, tmp_path,
                          lambda: steps.read_text().count("step") if steps.is_file() else 0, 1)
    assert child.code == 0 and child.train_kib < 100 * 1024 and child.peak_kib >= 300 * 1024


def test_a_hung_child_is_killed_at_the_timeout(tmp_path):
    start = time.monotonic()
    child = rss.run_child([sys.executable, "-c", "import time; time.sleep(60)"], tmp_path / "d.log", 1, tmp_path)
    assert child.code == rss.KILLED == -9 and time.monotonic() - start < 30


def test_the_child_runs_in_the_given_folder_with_unbuffered_output(tmp_path):
    script = "import os, sys; print(os.getcwd(), os.environ['PYTHONUNBUFFERED']); sys.exit(4)"
    child = rss.run_child([sys.executable, "-c", script], tmp_path / "e.log", 60, tmp_path)
    assert (child.code, child.output) == (4, f"{tmp_path} 1\n")
    assert (tmp_path / "e.log").read_text() == child.output


def test_a_sigterm_kills_the_running_child_and_what_it_started(tmp_path):
    signal.signal(signal.SIGTERM, peers._stop)
    started = "sleep 60 & echo $! $$; wait"  # a grandchild, as a compile worker is
    log = tmp_path / "f.log"
    pids: list[int] = []

    def steps_done() -> int:  # the signal arrives while run_child polls, once both pids are printed
        text = log.read_text()
        if text.strip() and not pids:
            pids.extend(int(pid) for pid in text.split())
            signal.raise_signal(signal.SIGTERM)
        return 0

    with pytest.raises(peers.Stopped):
        rss.run_child(["sh", "-c", started], log, 60, tmp_path, steps_done, 1)
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(pids) == 2 and not any(_alive(pid) for pid in pids)


def test_an_unreadable_process_has_no_vm_hwm():
    assert rss.vm_hwm_kib(os.getpid()) > 0
    assert rss.vm_hwm_kib(2**22 + 1) is None  # above the kernel's pid_max: no such process


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting to be reaped does not)."""
    try:
        return " Z " not in Path(f"/proc/{pid}/stat").read_text().split(")", 1)[1][:3]
    except OSError:
        return False
