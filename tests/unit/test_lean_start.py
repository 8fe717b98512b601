"""A daemon's start-up imports (common.lean, ddloco.entry): the optional packages redis-py and
structlog would load are skipped for them and importable afterwards; `ddloco learner` does not
import `ddloco up`'s parser; a learner imports with the garbage collector paused and numpy's BLAS
without its idle thread pool."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

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


def test_imports_run_with_the_collector_paused_and_their_objects_are_frozen_out_of_it_after(tmp_path: Path) -> None:
    code = """
        import gc, os
        from common.lean import pause_gc, resume_gc
        resume_gc()                      # nothing paused: nothing to do
        before = (gc.isenabled(), gc.get_freeze_count())
        paused = pause_gc(os.environ)
        during = gc.isenabled()
        import torch
        resume_gc()
        print(before, paused, during, gc.isenabled(), gc.get_freeze_count() > 1000)
    """
    assert _run(code, tmp_path) == "(True, 0) True False True True"
    # told not to, or the collector off already: nothing changes
    assert _run(code, tmp_path, env={"DDLOCO_FULL_IMPORTS": "1"}) == "(True, 0) False True True False"
    off = _run("import gc, os\ngc.disable()\nfrom common.lean import pause_gc, resume_gc\n"
               "print(pause_gc(os.environ)); resume_gc(); print(gc.isenabled(), gc.get_freeze_count())", tmp_path)
    assert off.split() == ["False", "False", "0"]


def test_numpy_s_blas_starts_without_its_idle_thread_pool_unless_told(tmp_path: Path) -> None:
    if (os.cpu_count() or 1) < 2:
        pytest.skip("OpenBLAS starts no pool on one core")
    code = """
        import os
        from common.lean import quiet_blas
        done = quiet_blas(os.environ)
        import numpy
        print(done, os.environ.get("OPENBLAS_NUM_THREADS"), len(os.listdir("/proc/self/task")))
    """
    assert _run(code, tmp_path) == "True 1 1"
    told = _run(code, tmp_path, env={"OPENBLAS_NUM_THREADS": "2"}).split()
    assert told[:2] == ["False", "2"] and int(told[2]) > 1      # the user's setting is kept
    full = _run(code, tmp_path, env={"DDLOCO_FULL_IMPORTS": "1"}).split()
    assert full[:2] == ["False", "None"] and int(full[2]) > 1
