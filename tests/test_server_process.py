"""vllm_specplugin/server.py: a server process started by VllmServer does not outlive the process
that started it (a benchmark stopped by kill once left two idle servers running beside the next
benchmarks). Checked with a stand-in child (a sleeping Python) started the same way, in its own
session as the server is; a real server was checked by hand the same way (its whole process group
gone within 15 s of its starter's SIGKILL). The kernel ties a child to the thread that started it,
so a server started from a thread that then ends (the soak's) must not be tied at all."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")

STARTER = """
import signal, sys, threading, time
from vllm_specplugin.server import spawn_tied_to_parent
if sys.argv[1] == "ignoring":  # a starter that ignores SIGINT (as a pytest-xdist worker may by then)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
children = []
def start():
    children.append(spawn_tied_to_parent([sys.executable, "-c", "import time; time.sleep(600)"],
                                         start_new_session=True))
    time.sleep(1.5)  # as VllmServer.__enter__ waits for /health: the child is past its start-up
if sys.argv[1] == "thread":  # started from a thread that then ends, as the soak starts its servers
    starter = threading.Thread(target=start)
    starter.start()
    starter.join()
else:
    start()
print(children[0].pid, flush=True)
time.sleep(600)
"""


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def _start(how: str) -> tuple[subprocess.Popen, int]:
    starter = subprocess.Popen([sys.executable, "-c", STARTER, how], stdout=subprocess.PIPE, text=True,
                               cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return starter, int(starter.stdout.readline())


def test_a_child_started_from_a_thread_outlives_that_thread():
    """The kernel ties a child to the thread that started it: from a thread that ends, no tie (the
    soak's servers must keep running after their starter threads end)."""
    starter, child = _start("thread")
    try:
        time.sleep(2.0)
        assert _running(child), "the child died with the thread that started it"
    finally:
        starter.kill()
        starter.wait()
        if _running(child):
            os.kill(child, 9)


@pytest.mark.parametrize("how", ["main", "ignoring"])
def test_the_child_dies_with_the_process_that_started_it(how):
    """Also when the starter ignores SIGINT: an ignored signal stays ignored across fork and exec, so
    the tie's SIGINT would do nothing to a child that installs no handler of its own (seen in make
    test: the stand-in outlived its starter in a worker left ignoring SIGINT by an earlier test)."""
    starter, child = _start(how)
    try:
        time.sleep(1.0)  # past the tie, in the child's exec'd program
        assert _running(child), "the stand-in child did not start"
        starter.kill()  # SIGKILL: no clean-up of its own runs
        starter.wait()
        deadline = time.monotonic() + 10
        while _running(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _running(child), "the child outlived the process that started it"
    finally:
        starter.kill()
        if _running(child):
            os.kill(child, 9)
