"""A daemon's start-up imports (common.lean, ddloco.entry): the optional packages redis-py and
structlog would load are skipped for them and importable afterwards; `ddloco learner` does not
import `ddloco up`'s parser."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _run(code: str, tmp_path: Path, env: dict[str, str] | None = None) -> str:
    """``code`` in a fresh interpreter whose path has a library that imports an optional module
    (``lib`` tries ``opt``, as redis-py tries the OpenTelemetry SDK); its stdout."""
    (tmp_path / "lib.py").write_text(textwrap.dedent("""
        try:
            import opt
            HAS_OPT = True
        except ImportError:
            HAS_OPT = False
    """))
    (tmp_path / "opt.py").write_text("LOADED = True\n")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True, text=True,
                          env={"PYTHONPATH": f"{tmp_path}:{REPO}", **(env or {})}, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_the_library_imports_without_the_optional_module_which_imports_normally_afterwards(tmp_path: Path) -> None:
    out = _run("""
        import sys
        from common.lean import import_without
        assert import_without("lib", ("opt",))
        import lib
        print(lib.HAS_OPT, "opt" in sys.modules)
        import opt
        print(opt.LOADED, import_without("lib", ("opt",)))
    """, tmp_path)
    assert out.split() == ["False", "False", "True", "False"]


def test_an_optional_module_imported_before_is_left_to_the_library(tmp_path: Path) -> None:
    out = _run("""
        import opt
        from common.lean import import_without
        import_without("lib", ("opt",))
        import lib
        print(lib.HAS_OPT)
    """, tmp_path)
    assert out == "True"


def test_a_daemon_start_skips_redis_opentelemetry_and_structlogs_rich_unless_told_not_to(tmp_path: Path) -> None:
    code = """
        import os, sys
        from common.lean import lean_start
        lean_start(os.environ, json_logs=True)
        import redis.observability.providers as p, structlog.dev as d
        print(p.OTEL_AVAILABLE, d.rich is not None)
    """
    lean = _run(code, tmp_path)
    full = _run(code, tmp_path, env={"DDLOCO_FULL_IMPORTS": "1"})
    plain = _run(code.replace("lean_start(os.environ, json_logs=True)", ""), tmp_path)
    assert lean == "False False"
    assert full == plain


def test_ddloco_learner_is_handed_its_arguments_without_ddloco_up_s_parser() -> None:
    proc = subprocess.run([sys.executable, "-c", "import sys, runpy\n"
                           "sys.argv = ['ddloco', 'learner', '--help']\n"
                           "try:\n    runpy.run_module('ddloco', run_name='__main__')\n"
                           "except SystemExit:\n    pass\n"
                           "print('LOADED', 'ddloco.cli' in sys.modules, 'syncer.cli' in sys.modules)"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "--learner-id" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == "LOADED False False"
