"""common.lifecycle.install_stop_handlers: the first stop signal stops gracefully, the same signal
delivered again within DUPLICATE_SIGNAL_S (a scheduler and a supervisor both passing it on) is
ignored, a later one exits at once. Real signals, in a child process (os._exit ends it)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import os, signal, threading
    from common.lifecycle import DUPLICATE_SIGNAL_S, install_stop_handlers
    t = [100.0]
    stop = threading.Event()
    install_stop_handlers(stop, now=lambda: t[0])
    os.kill(os.getpid(), signal.SIGTERM)          # graceful stop
    t[0] += 0.001
    os.kill(os.getpid(), signal.SIGTERM)          # the same request again (torchrun, a supervisor)
    print("alive after a duplicate:", stop.is_set(), flush=True)
    t[0] += DUPLICATE_SIGNAL_S + 0.5
    os.kill(os.getpid(), signal.SIGTERM)          # a user's second signal: now
    print("not reached", flush=True)
""")


def test_a_duplicate_stop_signal_is_ignored_and_a_later_one_exits_at_once():
    p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert "alive after a duplicate: True" in p.stdout, (p.stdout, p.stderr)
    assert "not reached" not in p.stdout
    assert p.returncode == 128 + 15, p.returncode
