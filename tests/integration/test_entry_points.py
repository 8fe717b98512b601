"""Each daemon package owns its entry point: `python -m learner|syncer|broker` run without ddloco."""
from __future__ import annotations

import subprocess
import sys

import pytest

DAEMONS = ("learner", "syncer", "broker")

_NO_DDLOCO = """
import runpy, sys
sys.argv = [{daemon!r}, *{argv!r}]
try:
    runpy.run_module({daemon!r}, run_name="__main__")
except SystemExit as e:
    code = e.code
print("ddloco modules:", sorted(m for m in sys.modules if m == "ddloco" or m.startswith("ddloco.")))
sys.exit(code)
"""


def _run(daemon: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _NO_DDLOCO.format(daemon=daemon, argv=list(argv))],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("daemon", DAEMONS)
def test_a_daemons_help_comes_from_its_own_package_without_importing_ddloco(daemon):
    res = _run(daemon, "--help")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith(f"usage: ddloco {daemon} ") and "--redis-url" in res.stdout, res.stdout
    assert res.stdout.rstrip().endswith("ddloco modules: []"), res.stdout[-500:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("daemon, argv, line", [
    ("learner", ["--redis-url", "http://x"], "ddloco learner: --redis-url 'http://x': not a Redis URL"),
    ("syncer", ["--rpc-bind", "tcp://host"], "ddloco syncer: --rpc-bind 'tcp://host': a tcp endpoint is"),
    ("broker", ["--xsub", "bogus"], "ddloco broker: --xsub 'bogus': not a ZeroMQ endpoint"),
])
def test_a_daemons_bad_flag_is_one_line_and_exit_2_without_importing_ddloco(daemon, argv, line):
    res = _run(daemon, *argv, "--insecure")
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert res.stderr.startswith(line) and res.stderr.count("\n") == 1, res.stderr
    assert "ddloco modules: []" in res.stdout, res.stdout


@pytest.mark.timeout(120)
@pytest.mark.parametrize("daemon", DAEMONS)
def test_an_unknown_argument_is_refused_as_ddloco_always_refused_it(daemon):
    res = _run(daemon, "--bogus", "x")
    assert (res.returncode, res.stderr) == (2, "usage: ddloco [-h] COMMAND ...\n"
                                               "ddloco: error: unrecognized arguments: --bogus x\n"), res.stderr
