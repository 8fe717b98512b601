"""``python -m ddloco.bench.dashboard``: what the dashboard costs and how live it is, with a real
headless browser (Debian's chromium through selenium).

- **Responsiveness**: ``ddloco up --learners N --syncers S --step-time-floor-ms F --dashboard 0``;
  once every learner trains, the page is loaded ``--loads`` times (first contentful paint, from
  the browser's own timing) and then, for ``--watch-s`` seconds, how far behind the page is (now
  minus the time of the snapshot it shows, read from the page every 0.5 s).
- **Cost**: ``make demo``'s run (``up`` with its defaults) ``--pairs`` times without and with the page
  open, alternating; steps/s and merges/s from each report (steps and merges over wall time).

Prints a JSON object (``--json FILE`` also writes it).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Sequence


def browser() -> Any:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    chromium, driver = shutil.which("chromium") or shutil.which("chromium-browser"), shutil.which("chromedriver")
    if not chromium or not driver:
        raise SystemExit("bench dashboard: needs chromium and chromedriver (apt-get install chromium chromium-driver)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1400,1600"):
        opts.add_argument(a)
    return webdriver.Chrome(service=Service(driver), options=opts)


class Up:
    """A ``ddloco up`` child with its output read on a thread (the dashboard's address found in it)."""

    def __init__(self, args: Sequence[str], cwd: Path) -> None:
        self.lines: list[str] = []
        self.proc = subprocess.Popen([sys.executable, "-m", "ddloco", "up", *args], cwd=cwd, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        threading.Thread(target=lambda: self.lines.extend(iter(self.proc.stdout.readline, "")), daemon=True).start()

    def url(self, timeout_s: float = 180) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for ln in list(self.lines):
                m = re.search(r"dashboard  (http://127\.0\.0\.1:\d+/)", ln)
                if m:
                    return m.group(1)
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError("up printed no dashboard address:\n" + "".join(self.lines)[-2000:])

    def wait(self, timeout_s: float) -> int:
        return self.proc.wait(timeout=timeout_s)


def _all_training(page: Any, n: int) -> bool:
    return page.execute_script(
        "return document.querySelectorAll('#learners tr[data-status=\"training\"]').length") >= n


def responsiveness(learners: int, syncers: int, floor_ms: float, minutes: float, loads: int, watch_s: float,
                   cwd: Path, screenshot: str | None = None) -> dict[str, Any]:
    up = Up(["--learners", str(learners), "--syncers", str(syncers), "--steps", "0", "--minutes", str(minutes),
             "--step-time-floor-ms", str(floor_ms), "--dashboard", "0", "--insecure"], cwd)
    page = browser()
    try:
        url = up.url()
        page.get(url)
        t0 = time.monotonic()
        while not _all_training(page, learners) and time.monotonic() - t0 < 240:
            time.sleep(0.5)
        trained = _all_training(page, learners)
        paints = []
        for _ in range(loads):
            page.get("about:blank")
            page.get(url)
            fcp = page.execute_script("const p = performance.getEntriesByName('first-contentful-paint'); "
                                      "return p.length ? p[0].startTime : null;")
            paints.append(fcp)
        lags = []
        end = time.monotonic() + watch_s
        while time.monotonic() < end:
            lag = page.execute_script("const t = Number(document.getElementById('status').dataset.t || 0); "
                                      "return t ? Date.now() / 1000 - t : null;")
            if lag is not None:
                lags.append(lag)
            time.sleep(0.5)
        shown = page.execute_script("return document.querySelectorAll('#learners tbody tr').length")
        if screenshot:
            page.save_screenshot(screenshot)
    finally:
        page.quit()
        up.proc.send_signal(2)
        up.wait(180)
    lags.sort()
    good = [p for p in paints if p is not None]
    return {"learners": learners, "syncers": syncers, "all_training_seen": trained, "learner_rows": shown,
            "first_paint_ms": good, "first_paint_ms_max": max(good) if good else None,
            "lag_s_median": statistics.median(lags) if lags else None,
            "lag_s_p95": lags[int(0.95 * (len(lags) - 1))] if lags else None, "lag_s_max": max(lags) if lags else None,
            "lag_samples": len(lags)}


def _read_stream(url: str) -> None:
    """Hold the page's event stream open and read it, as a page does, without rendering."""
    import http.client
    import urllib.request
    try:
        with urllib.request.urlopen(url + "api/stream", timeout=30) as resp:
            while resp.read(65536):
                pass
    except (OSError, http.client.HTTPException):   # the run ended: its server went away
        pass


def demo_run(with_page: bool, cwd: Path, report: Path, client: str = "browser") -> dict[str, Any]:
    """``client``: "browser" (headless chromium renders the page) or "stream" (the server's side
    only: its event stream read, nothing rendered)."""
    args = ["--report", str(report)] + (["--dashboard", "0"] if with_page else [])
    up = Up(args, cwd)
    page = None
    try:
        if with_page and client == "browser":
            page = browser()
            page.get(up.url())
        elif with_page:
            threading.Thread(target=_read_stream, args=(up.url(),), daemon=True).start()
        rc = up.wait(900)
    finally:
        if page is not None:
            page.quit()
    rep = json.loads((report / "report.json").read_text())
    return {"dashboard": with_page, "client": client if with_page else "", "rc": rc, "wall_s": rep["wall_s"], "steps": rep["steps_total"],
            "merges": rep["merges"], "steps_per_s": rep["steps_total"] / rep["wall_s"],
            "merges_per_s": rep["merges"] / rep["wall_s"]}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ddloco.bench.dashboard", description=__doc__.split("\n\n")[0])
    ap.add_argument("--learners", type=int, default=32)
    ap.add_argument("--syncers", type=int, default=4)
    ap.add_argument("--step-time-floor-ms", type=float, default=200.0)
    ap.add_argument("--minutes", type=float, default=4.0, help="cap of the responsiveness run (it is stopped sooner)")
    ap.add_argument("--loads", type=int, default=3, help="page loads timed (first contentful paint)")
    ap.add_argument("--watch-s", type=float, default=30.0, help="seconds the page's lag is sampled")
    ap.add_argument("--pairs", type=int, default=2, help="make demo runs without / with the page (0: none)")
    ap.add_argument("--skip-responsiveness", action="store_true")
    ap.add_argument("--client", choices=("browser", "stream"), default="browser", help="with the page: chromium "
                    "renders it (default), or only its event stream is read (the server's cost alone)")
    ap.add_argument("--json", metavar="FILE", help="also write the figures here")
    ap.add_argument("--screenshot", metavar="PNG", help="the page at the end of the responsiveness run")
    args = ap.parse_args(argv)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-dashboard-") as tmp:
        cwd = Path(tmp)
        if not args.skip_responsiveness:
            out["responsiveness"] = responsiveness(args.learners, args.syncers, args.step_time_floor_ms, args.minutes,
                                                   args.loads, args.watch_s, cwd,
                                                   screenshot=str(Path(args.screenshot).absolute()) if args.screenshot else None)
            print(json.dumps(out["responsiveness"]), file=sys.stderr, flush=True)
        runs = []
        for i in range(args.pairs):
            for with_page in (False, True):
                runs.append(demo_run(with_page, cwd, cwd / f"demo-{i}-{int(with_page)}", args.client))
                print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
        if runs:
            out["demo"] = runs
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
