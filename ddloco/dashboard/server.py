"""The dashboard's web server: one page (``page.html``, everything inline: no build step, nothing
fetched from the internet), the run's snapshot as JSON (``/api/state``), the same pushed once a
second over server-sent events (``/api/stream``), and the operator's actions (``POST
/api/action``, only with ``--actions`` and the run's operator token).

aiohttp (a kept asyncio HTTP server) serves it: one process holds every open page's event stream
without a thread each, and a slow page only ever gets the newest snapshot (nothing queues up).
Redis is read by one poller thread about once a second, whatever the number of pages: a dashboard
that lags or dies never slows a daemon.

Threads: the event loop owns the app and the snapshot; the poller runs ``RunView.poll`` in the
loop's default executor (one call at a time).
"""
from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
from importlib import resources
from typing import Any

from aiohttp import web

from ddloco.dashboard.actions import ActionError, parse_action
from ddloco.dashboard.collect import RunView

POLL_S = 1.0


def page_html(snapshot: dict[str, Any] | None = None) -> str:
    """The page; with ``snapshot`` it is the offline report (the views drawn once from it)."""
    html = resources.files("ddloco.dashboard").joinpath("page.html").read_text(encoding="utf-8")
    embedded = "null" if snapshot is None else json.dumps(snapshot).replace("</", "<\\/")
    return html.replace("/*SNAPSHOT*/null", embedded, 1)


class Dashboard:
    """The app around one ``RunView``; ``operator`` (None: actions off) carries out actions."""

    def __init__(self, view: RunView, *, token: str = "", operator: Any = None, poll_s: float = POLL_S) -> None:
        self.view, self.token, self.operator, self.poll_s = view, token, operator, poll_s
        self.snapshot: dict[str, Any] = {"run_id": view.keys.run_id, "t": time.time(), "error": "starting"}
        self.payload = json.dumps(self.snapshot)
        self.version = 0
        self._changed: asyncio.Condition | None = None
        self.polls = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/", self._page)
        app.router.add_get("/api/state", self._state)
        app.router.add_get("/api/stream", self._stream)
        app.router.add_post("/api/action", self._action)
        app.on_startup.append(self._start_poller)
        return app

    async def _start_poller(self, app: web.Application) -> None:
        self._changed = asyncio.Condition()
        app["poller"] = asyncio.get_running_loop().create_task(self._poll_forever())

    async def _poll_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = time.monotonic()
            try:
                snap = await loop.run_in_executor(None, self.view.poll)
            except Exception as e:   # a bad poll is shown on the page; the next one tries again
                snap = {**self.snapshot, "error": f"{type(e).__name__}: {e}"}
            snap["actions"] = self.operator is not None
            self.snapshot, self.payload = snap, json.dumps(snap)
            self.version += 1
            self.polls += 1
            assert self._changed is not None
            async with self._changed:
                self._changed.notify_all()
            await asyncio.sleep(max(0.05, self.poll_s - (time.monotonic() - started)))

    async def _page(self, request: web.Request) -> web.Response:
        return web.Response(text=page_html(), content_type="text/html", headers={"Cache-Control": "no-store"})

    async def _state(self, request: web.Request) -> web.Response:
        return web.Response(text=self.payload, content_type="application/json")

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store"})
        await resp.prepare(request)
        seen = -1
        assert self._changed is not None
        try:
            while True:
                if seen == self.version:
                    try:
                        async with self._changed:
                            await asyncio.wait_for(self._changed.wait(), timeout=15)
                    except asyncio.TimeoutError:   # the poller is stuck (a hung Redis): keep the stream open
                        pass
                if seen != self.version:
                    seen = self.version
                    await resp.write(f"data: {self.payload}\n\n".encode())
                else:
                    await resp.write(b": keep-alive\n\n")
        except ConnectionResetError:   # the page went away
            pass
        return resp

    def _authorised(self, request: web.Request) -> bool:
        given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        return bool(self.token) and hmac.compare_digest(given.encode(), self.token.encode())

    async def _action(self, request: web.Request) -> web.Response:
        if self.operator is None:
            return web.json_response({"error": "actions are off (start the dashboard with --actions)"}, status=403)
        if not self._authorised(request):
            return web.json_response({"error": "the run's operator token is required (Authorization: Bearer ...)"},
                                     status=403)
        try:
            body = await request.json()
            action = parse_action(body if isinstance(body, dict) else {})
            outcome = await asyncio.get_running_loop().run_in_executor(None, self.operator.submit, action)
        except (ActionError, ValueError) as e:
            return web.json_response({"error": str(e)}, status=400)
        return web.json_response({"ok": True, "outcome": outcome})


def serve_forever(dashboard: Dashboard, host: str, port: int) -> None:
    """Serve in this thread until the process ends (``ddloco dashboard``)."""
    web.run_app(dashboard.app(), host=host, port=port, print=None, handle_signals=True)


def serve_in_thread(dashboard: Dashboard, host: str, port: int) -> tuple[threading.Thread, int]:
    """Serve on a daemon thread of its own event loop (``ddloco up --dashboard``); returns the
    thread and the bound port (``port`` 0: a free one)."""
    ready: dict[str, Any] = {}
    started = threading.Event()

    def run() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        runner = web.AppRunner(dashboard.app(), handle_signals=False)
        try:
            loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, host, port)
            loop.run_until_complete(site.start())
            ready["port"] = site._server.sockets[0].getsockname()[1]   # type: ignore[union-attr]
        except OSError as e:
            ready["error"] = e
        started.set()
        if "error" not in ready:
            loop.run_forever()

    t = threading.Thread(target=run, name="dashboard", daemon=True)
    t.start()
    started.wait(30)
    if "error" in ready:
        raise ready["error"]
    return t, int(ready["port"])
