"""``ddloco dashboard``: the run's live page beside a running cluster (``ddloco up --dashboard``
starts the same inside ``up``)."""
from __future__ import annotations

import os
import sys
from typing import Mapping

from common import control, exits
from common.files import read_env_file
from common.config import ConfigError, Endpoints
from common.keys import Keys

DEFAULT_PORT = 8470
TOKEN_ENV = "DDLOCO_OPERATOR_TOKEN"


def operator_token(access: str | None, env: Mapping[str, str]) -> str:
    """The run's operator token: ``--access`` file's, else the environment's (``DDLOCO_OPERATOR_TOKEN``)."""
    if access:
        token = read_env_file(access).get(TOKEN_ENV, "")
        if token:
            return token
    return env.get(TOKEN_ENV, "")


def page_url(host: str, port: int, token: str = "") -> str:
    """What to open: the token rides in the fragment (#), which a browser never sends to a server."""
    return f"http://{host}:{port}/" + (f"#token={token}" if token else "")


def run_dashboard(endpoints: Endpoints, *, host: str, port: int, actions: bool, access: str | None,
                  env: Mapping[str, str] = os.environ) -> int:
    from ddloco.dashboard.actions import ProcessOperator
    from ddloco.dashboard.collect import RunView
    from ddloco.dashboard.server import Dashboard, serve_forever
    token = operator_token(access, env)
    if actions and not token:
        raise ConfigError(f"--actions needs the run's operator token: --access runs/<run>/access.env or {TOKEN_ENV}")
    r = control.connect(endpoints.redis_url)
    keys = Keys(endpoints.run_id)
    dash = Dashboard(RunView(r, keys), token=token, operator=ProcessOperator(r, keys) if actions else None)
    print(f"ddloco dashboard: run {endpoints.run_id} at {page_url(host, port)}"
          + (" (actions on: open it with #token=<the run's operator token>)" if actions else " (read-only)"),
          file=sys.stderr, flush=True)
    serve_forever(dash, host, port)
    return exits.OK
