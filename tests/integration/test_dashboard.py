"""The dashboard as an operator uses it: a live `ddloco up --dashboard --dashboard-actions`, a real
headless browser (Debian's chromium through selenium), a learner killed by the page's button and
seen to leave and rejoin, requests without the operator token refused (403) changing nothing, the
run stopped from the page, and the offline report.html drawn from the same views."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(240)
REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}


def _browser():
    """Headless chromium through selenium, or a skip naming what is missing."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not chromium or not driver:
        pytest.skip("no chromium / chromedriver installed (apt-get install chromium chromium-driver; "
                    "`make test` installs them where apt-get runs as root)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is a test extra: pip install -e '.[test]'")
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1400,1600"):
        opts.add_argument(a)
    return webdriver.Chrome(service=Service(driver), options=opts)


def _post(url: str, body: dict, token: str | None) -> tuple[int, dict]:
    req = urllib.request.Request(url + "api/action", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {token}"} if token is not None else {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _state(url: str) -> dict:
    with urllib.request.urlopen(url + "api/state", timeout=10) as resp:
        return json.loads(resp.read())


def _row(browser, learner: str) -> dict:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    try:
        rows = browser.find_elements(By.CSS_SELECTOR, f'#learners tr[data-learner="{learner}"]')
        return {"status": rows[0].get_attribute("data-status")} if rows else {}
    except StaleElementReferenceException:   # a row redrawn meanwhile: ask again
        return {}


def test_the_page_shows_the_run_live_and_its_kill_button_kills_a_learner_that_rejoins(tmp_path):
    browser = _browser()
    report = tmp_path / "report"
    proc = subprocess.Popen([sys.executable, "-m", "ddloco", "up", "--task", "examples.cnn:task", "--learners", "2",
                             "--syncers", "1", "--steps", "0", "--minutes", "3", "--step-time-floor-ms", "40",
                             "--eval-every-s", "2", "--dashboard", "0", "--dashboard-actions", "--report", str(report)],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        found = wait_until(lambda: next((m for ln in lines for m in [re.search(
            r"dashboard  (http://127\.0\.0\.1:\d+/)#token=(\S+)", ln)] if m), None), 90, what="the dashboard's address")
        url, token = found.group(1), found.group(2)
        access = next((tmp_path / "runs").glob("*/access.env")).read_text()
        assert f"DDLOCO_OPERATOR_TOKEN={token}" in access

        browser.get(f"{url}#token={token}")
        for lid in ("learner-0", "learner-1"):   # every learner, training
            wait_until(lambda: _row(browser, lid).get("status") == "training", 90, what=f"{lid} training on the page")
        canvas = lambda cid, attr: int(browser.find_element("id", cid).get_attribute(attr) or 0)  # noqa: E731
        points = wait_until(lambda: canvas("loss", "data-points") or None, 60, what="a loss point")
        merges = wait_until(lambda: canvas("heat", "data-merges") or None, 60, what="merges in the heatmap")
        wait_until(lambda: canvas("loss", "data-points") > points, 60, what="the loss chart gaining points")
        wait_until(lambda: canvas("heat", "data-merges") > merges, 60, what="the heatmap updating")
        assert browser.find_elements("css selector", "#merges tbody tr"), "no merge rows"

        # without the token (or with a wrong one) an action is refused and changes nothing
        before = _state(url)["learners"]["learner-0"]
        assert _post(url, {"action": "kill", "learner": "learner-0"}, None)[0] == 403
        assert _post(url, {"action": "kill", "learner": "learner-0"}, "not-the-token")[0] == 403
        after = _state(url)["learners"]["learner-0"]
        assert after["incarnation"] == before["incarnation"] and after["status"] == "training"
        assert not [m for m in _state(url)["marks"] if m["kind"] == "action"]

        # the page's kill button: learner-0 leaves and comes back (a new incarnation), as the page shows
        browser.find_element("css selector", '#learners tr[data-learner="learner-0"] button[data-action="kill"]').click()
        wait_until(lambda: any(m["kind"] == "action" and "killed" in m["text"] for m in _state(url)["marks"]), 30,
                   what="the kill recorded")
        wait_until(lambda: _state(url)["learners"]["learner-0"]["incarnation"] != before["incarnation"], 90,
                   what="learner-0 rejoining (a new incarnation)")
        wait_until(lambda: _row(browser, "learner-0").get("status") == "training", 90, what="learner-0 training again")
        marks = _state(url)["marks"]
        killed_at = next(m["t"] for m in marks if m["kind"] == "action")
        assert [m for m in marks if m["kind"] == "leave" and m["learner"] == "learner-0" and m["t"] >= killed_at - 1]
        assert [m for m in marks if m["kind"] == "join" and m["learner"] == "learner-0" and m["t"] >= killed_at - 1]
        assert any(state == "gone" for _, _, state in _state(url)["lanes"]["learner-0"])   # its lane shows the gap
        leaves = lambda: int(browser.find_element("id", "lanes").get_attribute("data-leaves") or 0)  # noqa: E731
        wait_until(lambda: leaves() >= 1, 10, what="the page marking the leave")

        # the other buttons' requests: every shard writes a checkpoint; a temporary learner joins and trains
        written = _state(url)["shards"]["0"]["checkpoints"]
        assert _post(url, {"action": "checkpoint"}, token)[0] == 200
        wait_until(lambda: _state(url)["shards"]["0"]["checkpoints"] > written, 60, what="the asked checkpoint")
        assert _post(url, {"action": "add", "n": 1, "seconds": 60}, token)[0] == 200
        wait_until(lambda: _state(url)["learners"].get("extra-0", {}).get("status") == "training", 120,
                   what="the added learner training")
        assert _post(url, {"action": "stall", "learner": "learner-1", "seconds": 0}, token)[0] == 400   # checked first

        status, body = _post(url, {"action": "stop"}, token)
        assert status == 200, body
        assert proc.wait(timeout=120) == 0, "".join(lines)[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
        reader.join(timeout=10)

    # the report: the same views, offline
    html = report / "report.html"
    assert html.exists(), "".join(lines)[-2000:]
    browser.get(html.as_uri())
    wait_until(lambda: _row(browser, "learner-1"), 10, what="the report's learner table")
    assert int(browser.find_element("id", "loss").get_attribute("data-points")) >= 2
    assert "report (offline)" in browser.find_element("id", "status").text
    browser.quit()
