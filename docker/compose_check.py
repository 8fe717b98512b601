"""`make compose-check`: the README's compose.yaml, run for real, and what it did, checked.

Builds the image (from an offline Debian base made with debootstrap where no registry is
reachable), brings the stack up with 2 learners, checks every health check and /metrics endpoint,
trains until the global model's held-out loss falls, scales learners 2 -> 4 -> 1 (distinct ids and
data streams; the ones scaled away leave gracefully), starts a learner the run must refuse (it
exits with the reason and is not restarted), stops the stack gracefully (shards checkpoint) and
removes it. Prints one line per check and exits non-zero if any failed.

Engines: `docker compose` where a Docker engine answers, else podman with podman-compose (>= 1.1;
installed into this interpreter's environment with pip when missing or older). On podman it also
handles what a sandbox needs: lowered ulimits (a private containers.conf) and no registry.

    python docker/compose_check.py [--keep] [--timeout-min 25]

Not part of `make test`: it needs a container engine and takes 5-15 minutes.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import control  # noqa: E402  (the repository's own package, no torch)
from common.keys import Keys  # noqa: E402

PROJECT = "ddlcheck"
RUN_ID = "compose"
IMAGE = "decoupled-diloco:latest"
OFFLINE_BASE = "localhost/ddloco-base:bookworm"
STATE = ROOT / "runs" / "compose-check"
PORTS = {"DDLOCO_REDIS_PORT": 16379, "DDLOCO_BROKER_METRICS_PORT": 19100,
         "DDLOCO_SYNCER0_METRICS_PORT": 19101, "DDLOCO_SYNCER1_METRICS_PORT": 19102}
CHECKS: list[tuple[bool, str]] = []
T0 = time.monotonic()


def say(msg: str) -> None:
    print(f"[{time.monotonic() - T0:6.1f}s] {msg}", flush=True)


def check(ok: bool, what: str) -> bool:
    CHECKS.append((ok, what))
    say(("ok    " if ok else "FAIL  ") + what)
    return ok


def wait_for(pred: Callable[[], Any], timeout_s: float, what: str, every_s: float = 2.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            got = pred()
        except Exception as e:  # noqa: BLE001 - a poll that fails is retried until the deadline
            got, err = None, e
        else:
            err = None
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout_s:.0f} s" + (f" (last error: {err})" if err else ""))
        time.sleep(every_s)


class Engine:
    """docker + `docker compose`, or podman + podman-compose, with the environment they need."""

    def __init__(self) -> None:
        self.env = dict(os.environ)
        self.probe_image = ""
        if shutil.which("docker") and _ok(["docker", "info"]):
            self.name, self.compose_argv = "docker", ["docker", "compose"]
            return
        if not shutil.which("podman"):
            _apt_install(["podman", "uidmap", "slirp4netns", "fuse-overlayfs", "runc"], "podman")
        self.name = "podman"
        self.compose_argv = [_podman_compose()]

    def run(self, *args: str, check_rc: bool = True, capture: bool = True, timeout: float | None = None,
            ) -> subprocess.CompletedProcess[str]:
        res = subprocess.run([self.name, *args], env=self.env, text=True, timeout=timeout,
                             capture_output=capture)
        if check_rc and res.returncode != 0:
            raise RuntimeError(f"{self.name} {' '.join(args[:3])} ... exit {res.returncode}: "
                               f"{(res.stderr or '')[-1500:]}")
        return res

    def compose(self, *args: str, capture: bool = False, timeout: float | None = None) -> None:
        argv = [*self.compose_argv, "-p", PROJECT, "-f", str(ROOT / "compose.yaml"), *args]
        say("$ " + " ".join(Path(argv[0]).name if i == 0 else a for i, a in enumerate(argv)))
        res = subprocess.run(argv, env=self.env, cwd=ROOT, text=True, capture_output=capture, timeout=timeout)
        if res.returncode != 0:
            tail = ((res.stdout or "") + (res.stderr or ""))[-2000:] if capture else ""
            raise RuntimeError(f"compose {' '.join(args)} exit {res.returncode} {tail}")

    def containers(self, service: str, *, all_states: bool = False) -> list[str]:
        args = ["ps", "--format", "{{.Names}}", "--filter", f"label=com.docker.compose.project={PROJECT}",
                "--filter", f"label=com.docker.compose.service={service}"]
        out = self.run(*(args + (["-a"] if all_states else []))).stdout
        return sorted(n for n in out.split() if n)

    def scale_down(self, service: str, n: int) -> None:
        """podman-compose (1.6) adds replicas on `--scale` but never removes them: stop the extra
        ones (newest first) as `docker compose` would, with the service's stop signal and grace."""
        extra = sorted(self.containers(service), key=lambda c: int(c.rsplit("_", 1)[-1]))[n:]
        if self.name != "podman" or not extra:
            return
        say(f"podman-compose leaves extra replicas on scale-down; stopping {', '.join(extra)} (SIGTERM, 15 s grace)")
        self.run("stop", "-t", "15", *extra)
        self.run("rm", *extra)

    def remove_stack(self) -> None:
        """Containers and named volumes of the check's project (a checkpoint left by an earlier
        check would resume that run)."""
        try:
            self.compose("down", "-v", capture=True, timeout=180)
        except (RuntimeError, subprocess.SubprocessError) as e:
            say(f"compose down: {e}")
        vols = [v for v in self.run("volume", "ls", "-q", check_rc=False).stdout.split()
                if v.startswith(f"{PROJECT}_")]
        if vols:   # podman-compose 1.6 `down -v` keeps them
            self.run("volume", "rm", "-f", *vols, check_rc=False)

    def inspect(self, name: str, fmt: str) -> str:
        return self.run("inspect", "--format", fmt, name).stdout.strip()

    def healthy(self, name: str) -> bool:
        """docker runs health checks itself; podman without systemd does not, so run it once."""
        if self.name == "docker":
            return self.inspect(name, "{{.State.Health.Status}}") == "healthy"
        return self.run("healthcheck", "run", name, check_rc=False).returncode == 0

    def in_image(self, *argv: str, timeout: float = 300, volume: str = "keys") -> str:
        """A one-off container of the image on the stack's network with one of its volumes."""
        res = self.run("run", "--rm", "--network", f"{PROJECT}_default", "-v", f"{PROJECT}_{volume}:/{volume}",
                       "--entrypoint", argv[0], IMAGE, *argv[1:], timeout=timeout)
        return res.stdout


def _ok(argv: list[str]) -> bool:
    try:
        return subprocess.run(argv, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _apt_install(packages: list[str], why: str) -> None:
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise SystemExit(f"compose-check: no {why}: install {' '.join(packages)} (Debian/Ubuntu package names)")
    say(f"installing {' '.join(packages)} with apt-get (needed: {why})")
    subprocess.run(["apt-get", "update", "-qq"], check=True)
    subprocess.run(["apt-get", "install", "-y", "-qq", *packages], check=True,
                   env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"}, stdout=subprocess.DEVNULL)


def _podman_compose() -> str:
    """podman-compose >= 1.1 (older ones ignore depends_on conditions and --scale)."""
    here = Path(sys.executable).parent / "podman-compose"
    for cand in (str(here), shutil.which("podman-compose") or ""):
        if cand and Path(cand).exists():
            out = subprocess.run([cand, "--version"], capture_output=True, text=True).stdout
            ver = next((ln.split()[-1] for ln in out.splitlines() if "podman-compose" in ln), "0")
            if tuple(int(x) for x in ver.split(".")[:2] if x.isdigit()) >= (1, 1):
                return cand
    say("installing podman-compose>=1.5 into this environment with pip")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "podman-compose>=1.5"], check=True)
    return str(here)


def prepare_podman(engine: Engine) -> None:
    """Lowered ulimits: podman's default nofile/nproc may exceed what this sandbox allows."""
    if engine.name != "podman":
        return
    probe = engine.run("run", "--rm", "--entrypoint", "true", engine.probe_image, check_rc=False)
    if probe.returncode != 0 and "rlimit" in probe.stderr:
        conf = STATE / "containers.conf"
        conf.parent.mkdir(parents=True, exist_ok=True)
        nofile = int(subprocess.run(["sh", "-c", "ulimit -Hn"], capture_output=True, text=True).stdout or 1024)
        nproc = subprocess.run(["sh", "-c", "ulimit -Hu"], capture_output=True, text=True).stdout.strip()
        nproc_v = 4096 if nproc in ("", "unlimited") else min(4096, int(nproc))
        conf.write_text(f'[containers]\ndefault_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc_v}:{nproc_v}"]\n')
        engine.env["CONTAINERS_CONF"] = str(conf)
        say(f"containers could not set podman's default ulimits here; using {conf} (nofile {nofile}, nproc {nproc_v})")
        probe = engine.run("run", "--rm", "--entrypoint", "true", engine.probe_image, check_rc=False)
    check(probe.returncode == 0, f"a container starts ({engine.name}, image {engine.probe_image})"
          + ("" if probe.returncode == 0 else f": {probe.stderr[-500:]}"))
    if probe.returncode != 0:
        raise SystemExit(1)


def base_image(engine: Engine) -> str:
    """The image's base: $DDLOCO_BASE_IMAGE, else python:3.11-slim when a registry answers, else
    a Debian base made here with debootstrap (trusting this machine's CA bundle, for pip)."""
    if os.environ.get("DDLOCO_BASE_IMAGE"):
        return os.environ["DDLOCO_BASE_IMAGE"]
    if engine.run("image", "exists" if engine.name == "podman" else "inspect", OFFLINE_BASE,
                  check_rc=False).returncode == 0:
        say(f"using the offline base {OFFLINE_BASE} made earlier")
        return OFFLINE_BASE
    pulled = subprocess.run([engine.name, "pull", "-q", "python:3.11-slim"], env=engine.env, capture_output=True,
                            text=True, timeout=120).returncode == 0 if _registry_reachable() else False
    if pulled:
        return "python:3.11-slim"
    say("no registry reachable: building an offline Debian base with debootstrap (a few minutes, once)")
    if not shutil.which("debootstrap"):
        _apt_install(["debootstrap"], "debootstrap for the offline base")
    with tempfile.TemporaryDirectory(prefix="ddloco-base-", dir="/var/tmp") as tmp:
        rootfs = Path(tmp) / "rootfs"
        subprocess.run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates",
                        "bookworm", str(rootfs), "http://deb.debian.org/debian"], check=True,
                       stdout=subprocess.DEVNULL)
        ca = Path("/etc/ssl/certs/ca-certificates.crt")
        if ca.exists():  # this machine's trust (a TLS-inspecting proxy's CA included) for pip in the build
            shutil.copy(ca, rootfs / "etc/ssl/certs/ca-certificates.crt")
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        subprocess.run([engine.name, "import", "-", OFFLINE_BASE], stdin=tar.stdout, env=engine.env, check=True,
                       stdout=subprocess.DEVNULL)
        tar.wait()
    return OFFLINE_BASE


def _registry_reachable() -> bool:
    try:
        urllib.request.urlopen("https://registry-1.docker.io/v2/", timeout=10)
    except urllib.error.HTTPError:
        return True  # 401: it answers
    except OSError:
        return False
    return True


def torch_flags() -> str:
    """pip flags for torch in the build: the CPU index when it answers, else a local wheel copied
    into docker/wheels (this machine's pip finds the CPU build of torch 2.13.0 on disk)."""
    try:
        urllib.request.urlopen("https://download.pytorch.org/whl/cpu/torch/", timeout=10)
        return "--index-url https://download.pytorch.org/whl/cpu"
    except OSError:
        pass
    wheels = ROOT / "docker" / "wheels"
    if not list(wheels.glob("torch-2.13.0*.whl")):
        say("the PyTorch CPU index is not reachable: copying the local torch 2.13.0 wheel into docker/wheels")
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "torch==2.13.0", "-d",
                        str(wheels)], check=True)
    return "--find-links /wheels"   # not empty: compose's ${VAR:-default} would take the default


def redis_client(engine: Engine) -> Any:
    password = engine.in_image("cat", "/keys/secret/redis.password").strip()
    return control.connect(f"redis://:{password}@127.0.0.1:{PORTS['DDLOCO_REDIS_PORT']}/0")


def global_eval(engine: Engine) -> tuple[float, int]:
    """Held-out loss of the global model as the live shards hold it, and the sum of versions."""
    code = ("import json; from ddloco.export import from_live_run; from common.task import evaluate, bind_task;"
            "from common import control; from common.keys import Keys;"
            "p = open('/keys/secret/redis.password').read().strip(); url = f'redis://:{p}@redis:6379/0';"
            f"m, v = from_live_run(url, {RUN_ID!r}, keys_dir='/keys');"
            f"r = control.connect(url); run = control.fetch_run_config(r, Keys({RUN_ID!r})); task, _ = bind_task(run, None);"
            "print(json.dumps({'loss': evaluate(task, m), 'versions': sum(v.values())}))")
    out = engine.in_image("python", "-c", code).strip().splitlines()[-1]
    got = json.loads(out)
    return float(got["loss"]), int(got["versions"])


def live(r: Any) -> dict[str, dict[str, str]]:
    return control.live_learners(r, Keys(RUN_ID))


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        return reply.read().decode()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keep", action="store_true", help="leave the stack and its volumes up at the end")
    ap.add_argument("--timeout-min", type=float, default=25.0, help="give up after this long (default 25)")
    args = ap.parse_args()
    engine = Engine()
    say(f"engine: {engine.name}, compose: {' '.join(engine.compose_argv)}")
    base = base_image(engine)
    engine.probe_image = base
    prepare_podman(engine)
    engine.env.update({k: str(v) for k, v in PORTS.items()})
    engine.env["DDLOCO_BASE_IMAGE"] = base
    engine.env["DDLOCO_TORCH_PIP_FLAGS"] = torch_flags()
    deadline_s = args.timeout_min * 60
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # Ctrl-C or SIGTERM: still remove the stack
    engine.remove_stack()
    try:
        t = time.monotonic()
        engine.compose("build")
        check(engine.run("image", "inspect", IMAGE, check_rc=False).returncode == 0,
              f"image {IMAGE} built once, from {base} ({time.monotonic() - t:.0f} s)")
        engine.compose("up", "-d", "--scale", "learner=2")
        r = wait_for(lambda: redis_client(engine), 120, "Redis reachable on its published port")
        for svc in ("redis", "broker", "syncer-0", "syncer-1"):
            names = engine.containers(svc)
            wait_for(lambda n=names: n and all(engine.healthy(x) for x in n), 240, f"{svc} healthy", 3)
            check(True, f"{svc}: health check passes ({names[0]})")
        lv = wait_for(lambda: len(live(r)) == 2 and live(r), 600, "2 learners live", 3)
        check(len(lv) == 2, f"2 learners joined: {', '.join(sorted(lv))}")
        for name, port in (("broker", PORTS["DDLOCO_BROKER_METRICS_PORT"]),
                           ("syncer-0", PORTS["DDLOCO_SYNCER0_METRICS_PORT"]),
                           ("syncer-1", PORTS["DDLOCO_SYNCER1_METRICS_PORT"])):
            text = scrape(port)
            n = sum(1 for ln in text.splitlines() if ln.startswith("ddloco_"))
            check("ddloco_up" in text and n > 5, f"{name}: Prometheus scrape on the published port {port}: {n} ddloco_ samples")
        loss0, v0 = global_eval(engine)
        say(f"global model: eval loss {loss0:.3f} at versions {v0}")
        wait_for(lambda: sum(int(h.get("merged_contributions", 0)) for h in live(r).values()) >= 40, 600,
                 "40 merged contributions", 5)
        loss1, v1 = global_eval(engine)
        check(loss1 < loss0 and v1 > v0, f"the global eval loss falls: {loss0:.3f} -> {loss1:.3f} "
              f"(versions {v0} -> {v1})")

        engine.compose("up", "-d", "--no-recreate", "--scale", "learner=4")
        lv = wait_for(lambda: len(live(r)) == 4 and live(r), 600, "4 learners live", 3)
        streams = {lid: h.get("data_stream") for lid, h in lv.items()}
        check(len(set(streams.values())) == 4, f"scaled to 4: distinct ids and data streams {streams}")
        before = set(lv)
        engine.compose("up", "-d", "--no-recreate", "--scale", "learner=1")
        engine.scale_down("learner", 1)
        lv = wait_for(lambda: len(live(r)) == 1 and live(r), 300, "1 learner live", 2)
        gone = before - set(lv)
        statuses = {lid: r.hget(Keys(RUN_ID).learner(lid), "status") for lid in gone}
        check(all(s == "left" for s in statuses.values()),
              f"scaled to 1: {len(gone)} learners left gracefully {statuses}")
        merged0 = int(next(iter(lv.values())).get("merged_contributions", 0))
        wait_for(lambda: int(next(iter(live(r).values())).get("merged_contributions", 0)) > merged0 + 5, 300,
                 "the last learner still contributing", 3)
        check(True, "training goes on with 1 learner")

        refused = f"{PROJECT}-refused"
        engine.run("rm", "-f", refused, check_rc=False)
        engine.run("run", "-d", "--name", refused, "--network", f"{PROJECT}_default", "-v", f"{PROJECT}_keys:/keys",
                   "--restart", "on-failure", "-e", "DDLOCO_REFUSED_EXIT_CODE=0", "-e", "DDLOCO_KEYS=/keys",
                   "--entrypoint", "sh", IMAGE, "-c",
                   "ddloco keys --dir /keys --learner-ids refused >/dev/null && export "
                   "DDLOCO_REDIS_URL=\"redis://:$(cat /keys/secret/redis.password)@redis:6379/0\" && exec ddloco "
                   f"learner --learner-id refused --run-id {RUN_ID} --broker-pub tcp://broker:5555 "
                   "--broker-sub tcp://broker:5556 --fragments 12")
        wait_for(lambda: engine.inspect(refused, "{{.State.Status}}") == "exited", 300, "the refused learner exits", 3)
        code = engine.inspect(refused, "{{.State.ExitCode}}")
        restarts = engine.inspect(refused, "{{.RestartCount}}")
        logs = engine.run("logs", refused).stderr + engine.run("logs", refused).stdout
        reason = next((ln for ln in logs.splitlines() if "refused" in ln), "")
        check(code == "0" and restarts in ("0", "") and "refused" in reason,
              f"a mismatched learner exits {code} with its reason and is not restarted ({restarts or 0} restarts): "
              f"{reason.strip()[:160]}")
        engine.run("rm", "-f", refused, check_rc=False)
        if time.monotonic() - T0 > deadline_s:
            raise TimeoutError("compose-check ran past --timeout-min")

        engine.compose("stop")
        for svc in ("syncer-0", "syncer-1", "broker", "learner"):
            for name in engine.containers(svc, all_states=True):
                code = engine.inspect(name, "{{.State.ExitCode}}")
                check(code == "0", f"graceful stop: {name} exited {code}")
        files = engine.in_image("ls", "/checkpoints", volume="checkpoints", timeout=120).split()
        shards = [f for f in files if f.startswith(f"{RUN_ID}-shard") and f.endswith(".pt")]
        check(len(shards) == 2, f"shard checkpoints on the named volume: {shards}")
    except (TimeoutError, RuntimeError, subprocess.SubprocessError, OSError) as e:
        check(False, f"{type(e).__name__}: {e}")
        for svc in ("syncer-0", "learner", "broker"):
            for name in engine.containers(svc, all_states=True)[:1]:
                out = engine.run("logs", "--tail", "15", name, check_rc=False)
                say(f"--- last lines of {name}:\n{(out.stdout + out.stderr)[-2500:]}")
    finally:
        if not args.keep:
            engine.remove_stack()
    failed = [w for ok, w in CHECKS if not ok]
    print(f"\ncompose-check: {len(CHECKS) - len(failed)} of {len(CHECKS)} checks passed in "
          f"{time.monotonic() - T0:.0f} s" + ("" if not failed else f"; FAILED: {failed}"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
