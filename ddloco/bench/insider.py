"""Issue 26's measure: the global model with one compromised learner among honest ones, against
the clean run of the same seed, at equal honest tokens.

    python -m ddloco.bench.insider --attacks signflip,signflip-adaptive,freerider,flood --minutes 2.5 \\
        --seeds 0,1 --out reports/insider        # also: ddloco bench insider ...

Per seed: a clean ``ddloco up --task examples.cnn:task --learners 4 --syncers 2 --minutes M
--step-time-floor-ms F --seed S`` (the README's example CNN), then per attack the same command
with the attacker beside it: once every learner trains, ``ddloco fuzz --insider --attack A`` runs
for the rest of the run with exactly what a learner host holds (the run's keys folder, where
``fuzz`` lists its own learner key, and a learner's Redis URL, read from a learner process's
environment), the operator's URL only to watch. The eval loss of each run is read from its
report's eval curve at the smaller of the two runs' token counts (the attacker writes no token
share: the count is the honest learners'). Writes OUT/insider-bench.json and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from common.files import read_env_file
from common.lifecycle import stop_processes
from ddloco.bench.equal_tokens import loss_at


def _ddloco(*args: str) -> list[str]:
    return [sys.executable, "-m", "ddloco", *args]


def up_argv(run_id: str, seed: int, args: argparse.Namespace, report: Path) -> list[str]:
    return _ddloco("up", "--task", args.task, "--learners", str(args.learners), "--syncers", "2",
                   "--minutes", str(args.minutes), "--step-time-floor-ms", str(args.step_time_floor_ms),
                   "--seed", str(seed), "--run-id", run_id, "--report", str(report), "--quiet")


def learner_redis_url(admin_url: str, run_id: str, learners: int, deadline: float) -> str:
    """Once ``learners`` learners train: the Redis URL in one learner process's environment (what
    its host holds)."""
    from common import control
    from common.keys import Keys
    r, keys = control.connect(admin_url), Keys(run_id)
    while time.time() < deadline:
        live = control.live_learners(r, keys)
        training = [h for h in live.values() if h.get("status") == "training" and h.get("pid")]
        if len(training) >= learners:
            env = Path(f"/proc/{training[0]['pid']}/environ").read_bytes().split(b"\0")
            found = [e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"DDLOCO_REDIS_URL=")]
            if found:
                return found[0]
        time.sleep(0.5)
    raise RuntimeError(f"{learners} learners of {run_id} were not training in time")


def _workdir(cwd: Path, run_id: str, deadline: float) -> Path:
    while time.time() < deadline:
        found = sorted((cwd / "runs").glob(f"{run_id}-*/access.env")) if (cwd / "runs").exists() else []
        if found:
            return found[-1].parent
        time.sleep(0.3)
    raise RuntimeError(f"`ddloco up` of {run_id} wrote no access.env")


def attacked_run(attack: str, seed: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """``ddloco up`` with ``ddloco fuzz --insider --attack attack`` beside it."""
    run_id, cwd = f"ins-{attack}-s{seed}", out / "work"
    t0 = time.time()
    up = subprocess.Popen(up_argv(run_id, seed, args, out / f"{attack}-s{seed}"), cwd=cwd,
                          stdout=open(out / f"{attack}-s{seed}-up.log", "w"), stderr=subprocess.STDOUT)
    try:
        workdir = _workdir(cwd, run_id, t0 + 120)
        access = read_env_file(workdir / "access.env")
        url = learner_redis_url(access["DDLOCO_REDIS_URL"], run_id, args.learners, t0 + 180)
        seconds = max(5.0, args.minutes * 60 - (time.time() - t0) - 3)
        env = {**os.environ, "DDLOCO_REDIS_URL": url, "DDLOCO_KEYS": access.get("DDLOCO_KEYS", ""),
               "DDLOCO_OBSERVER_REDIS_URL": access["DDLOCO_REDIS_URL"]}
        fz = subprocess.run(_ddloco("fuzz", "--insider", "--config", str(workdir / "config.toml"), "--attack", attack,
                                    "--seconds", f"{seconds:.0f}", "--settle-seconds", "0",
                                    "--report", str(out / f"{attack}-s{seed}-fuzz")),
                            cwd=cwd, env=env, capture_output=True, text=True)
        up.wait(timeout=args.minutes * 60 + 300)
    finally:
        stop_processes([up], 60.0)
    ins_path = out / f"{attack}-s{seed}-fuzz" / "insider.json"
    if not ins_path.exists():
        raise RuntimeError(f"ddloco fuzz --insider wrote no report: {fz.stdout[-1500:]}{fz.stderr[-1500:]}")
    entry = json.loads(ins_path.read_text())["attacks"][0]
    return {"report": json.loads((out / f"{attack}-s{seed}" / "report.json").read_text()), "up_exit": up.returncode,
            "insider": entry}


def clean_run(seed: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    res = subprocess.run(up_argv(f"ins-clean-s{seed}", seed, args, out / f"clean-s{seed}"), cwd=out / "work",
                         capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"the clean run failed: {res.stdout[-1500:]}{res.stderr[-1500:]}")
    return json.loads((out / f"clean-s{seed}" / "report.json").read_text())


def compare(attack: str, seed: int, clean: dict[str, Any], attacked: dict[str, Any]) -> dict[str, Any]:
    """One row: eval loss of both runs at the smaller honest token count, crashes, attacker result."""
    rep, e = attacked["report"], attacked["insider"]
    tokens = min(clean["tokens_total"], rep["tokens_total"])
    lc, la = loss_at(clean["eval_curve"], tokens), loss_at(rep["eval_curve"], tokens)
    a = e["attacker"]
    result = ", ".join(f"{k} {v}" for k, v in a.items() if k in ("answers_sent", "allowed", "rate_per_s",
                                                                  "marker_appeared"))
    m = e.get("merges", {})
    if m.get("merges_with_attacker"):
        result += f"; in {m['merges_with_attacker']}/{m['merges']} merges, weight mean {m['attacker_weight_mean']:.2f}" \
                  f" max {m['attacker_weight_max']:.2f}"
    return {"attack": attack, "seed": seed, "tokens": tokens, "eval_clean": round(lc, 4), "eval_attacked": round(la, 4),
            "ratio": round(la / lc, 3), "crashes": e["cluster"]["crashes"], "up_exit": attacked["up_exit"],
            "attacker": result, "defended": e["defended"]}


def main(argv: Sequence[str] | None = None) -> int:
    from ddloco.insider import parse_attacks
    # the runs work in OUT/work: the task (examples.cnn by default) is imported from this checkout
    root = str(Path(__file__).resolve().parents[2])   # the checkout (for examples.cnn)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)
    ap = argparse.ArgumentParser(prog="python -m ddloco.bench.insider", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attacks", default="signflip,signflip-adaptive,freerider,flood",
                    help="attacks (ddloco fuzz --insider's names; default the four that aim at the model)")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    ap.add_argument("--minutes", type=float, default=2.5, help="each run's length (default 2.5: >= 2 under attack)")
    ap.add_argument("--learners", type=int, default=4, help="honest learners (default 4)")
    ap.add_argument("--step-time-floor-ms", type=float, default=100.0, help="(default 100)")
    ap.add_argument("--task", default="examples.cnn:task", help="(default examples.cnn:task)")
    ap.add_argument("--out", default="reports/insider")
    args = ap.parse_args(argv)
    try:
        attacks, seeds = parse_attacks(args.attacks), [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError as e:
        ap.error(str(e))
    out = Path(args.out).absolute()
    (out / "work").mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in seeds:
        clean = clean_run(seed, args, out)
        for attack in attacks:
            rows.append(compare(attack, seed, clean, attacked_run(attack, seed, args, out)))
            print(json.dumps(rows[-1]), flush=True)
    (out / "insider-bench.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    print("\n| attack | seed | eval clean | eval attacked | ratio | crashes | attacker result |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['attack']} | {r['seed']} | {r['eval_clean']} | {r['eval_attacked']} | {r['ratio']} | "
              f"{len(r['crashes'])}{' (up exit %s)' % r['up_exit'] if r['up_exit'] else ''} | {r['attacker']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
