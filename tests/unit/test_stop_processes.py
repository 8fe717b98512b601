"""``common.lifecycle.stop_processes``, the one way to stop processes (daemons, benches, tests):
SIGTERM first (a graceful stop), SIGKILL for what is still running after the timeout."""
from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from common.lifecycle import stop_processes

pytestmark = pytest.mark.timeout(30)

_SERVE = "import signal, sys, threading\n{handler}\nprint('ready', flush=True)\nthreading.Event().wait()\n"


def _child(handler: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", _SERVE.format(handler=handler)], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline() == "ready\n"   # its handler is installed
    return p


def test_a_process_gets_sigterm_and_one_that_ignores_it_gets_sigkill():
    polite = _child("")
    stubborn = _child("signal.signal(signal.SIGTERM, signal.SIG_IGN)")
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    stop_processes([polite, stubborn, done], timeout_s=0.5)
    assert polite.returncode == -signal.SIGTERM
    assert stubborn.returncode == -signal.SIGKILL
    assert done.returncode == 0
    for p in (polite, stubborn):
        p.stdout.close()
