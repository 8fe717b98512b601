"""How a learner process comes to be: a hot spare (``learner --standby``), a fork of a prepared
standby (the factory `ddloco up` replaces failed learners with), or a torchrun group
(``learner --nproc N``).

    learner --standby     prepare (imports, run config, model, dry run), then read one JSON line
                          on stdin naming the learner to become; a line with "fork": true makes
                          the standby a factory: it forks a copy that becomes that learner
    learner --nproc N     exec ``torchrun --standalone --nproc-per-node N -m learner ARGS``

Threads: everything here runs on the process's main thread. ``_FORKED`` is written once, in a
forked child, before the child becomes its learner; ``forks`` (pid -> where its exit status
goes) belongs to the standby loop that reaps them.
"""
from __future__ import annotations

import json
import os
import select
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from common.config import ConfigError, ConfigFile, LearnerOptions, override
from common.exits import FAILURE
from common.files import write_atomic

_FORKED = False
"""This process is a learner forked by a standby factory (``learner --standby``, fork orders)."""


def forked() -> bool:
    """This process is a learner forked by a standby factory."""
    return _FORKED


def exec_torchrun(nproc: int, standby: bool, argv: Sequence[str]) -> int:
    """``learner --nproc N``: become ``torchrun --standalone --nproc-per-node N -m learner ARGS``
    (``argv``, the learner's arguments, less --nproc): N ranks, one learner of the run
    (learner/group.py). On several machines run torchrun yourself with its rendezvous flags."""
    if nproc < 1:
        raise ConfigError(f"--nproc must be >= 1, got {nproc}")
    if standby:
        raise ConfigError("--nproc and --standby cannot be combined (a standby is one process)")
    rest, skip = [], False
    for a in argv:
        flag = a.split("=", 1)[0]
        if skip:
            skip = False
        elif len(flag) >= 4 and "--nproc".startswith(flag):   # --nproc and what argparse takes for it (--npro)
            skip = "=" not in a
        else:
            rest.append(a)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "learner", *rest]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, cmd)   # signals reach torchrun, which passes them to every rank
    return FAILURE   # not reached


def standby(cfg: ConfigFile, opts: LearnerOptions, task: Any, run: Any, stop: threading.Event) -> int:
    """``learner --standby``: prepare everything that does not depend on the learner id (imports,
    run config, task, model, dry run), then wait for one JSON line on stdin naming the learner to
    become: ``{"learner_id": ..., "data_shard": ..., "max_steps": ..., "slowdown": ...}``. A
    supervisor keeps one standby process per machine so that a failed learner is replaced in well
    under a second (end of input: exit 0)."""
    from learner.core import Learner
    learner = Learner(endpoints=cfg.endpoints, options=override(opts, learner_id=opts.learner_id or "standby"),
                      task=task, run=run, stop=stop)
    learner.prepare()
    learner.warm_up()   # the first AdamW step, the metrics endpoint's imports
    print(json.dumps({"event": "learner.standby_ready", "pid": os.getpid()}), flush=True)
    forks: dict[int, str] = {}   # pid -> where its exit status goes
    line = _next_order(stop, forks)
    if line is None:
        return 0  # the supervisor went away
    if stop.is_set():
        _stop_forks(forks)
        return 0
    _become(learner, line, cfg, opts)
    return 0


def _next_order(stop: threading.Event, forks: dict[int, str]) -> str | None:
    """Read stdin until a line that is not a fork order (the factory forks one learner per fork
    order and reads on); None at the end of input, "" when stopped."""
    line = ""
    pending = b""   # read from fd 0 unbuffered: select() cannot see lines a buffered reader holds
    while not stop.is_set() and not line:
        reap_forks(forks)
        if b"\n" not in pending:
            ready, _, _ = select.select([0], [], [], 0.2)
            if not ready:
                continue
            chunk = os.read(0, 65536)
            if not chunk:
                return None
            pending += chunk
            continue
        raw, pending = pending.split(b"\n", 1)
        line = raw.decode(errors="replace") + "\n"
        if '"fork"' in line and fork_learner(line, forks):
            line = ""   # the factory: wait for the next order
    return line


def _stop_forks(forks: dict[int, str]) -> None:
    """Forked learners stop with the factory: each is asked to leave, and its exit status is still
    collected for the supervisor (after 20 s the parent-death signal ends the rest)."""
    for pid in forks:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 20.0
    while forks and time.monotonic() < deadline:
        reap_forks(forks)
        time.sleep(0.05)


def _become(learner: Any, line: str, cfg: ConfigFile, opts: LearnerOptions) -> None:
    """Become the learner ``line`` names (its id, data stream, budget, slowdown; its own Redis
    user), then train until it is done or stopped."""
    try:
        orders = json.loads(line)
        if orders.get("redis_url"):   # the learner's own Redis user (per-learner users, Redis >= 7)
            learner.use_redis_url(str(orders["redis_url"]))
        learner.assign(learner_id=str(orders["learner_id"]), data_shard=orders.get("data_shard"),
                       max_steps=orders.get("max_steps"), slowdown=orders.get("slowdown"),
                       metrics_port=orders.get("metrics_port"))
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--standby: expected one JSON line with learner_id, got {line[:200]!r} ({e})") from None
    if cfg.endpoints.keys_dir:
        from common.security import Security
        Security(cfg.endpoints.keys_dir, learner.id)  # SecurityError: exit 2 naming the missing key
    import torch
    torch.set_num_threads(opts.threads)
    learner.run()


def fork_learner(line: str, forks: dict[int, str]) -> bool:
    """A standby used as a factory (``{"fork": true, "log": PATH, "reply": PATH, ...}``): fork a
    copy of this prepared process to become the learner the line names, in well under a second
    and without a CPU second of imports, however many failures come at once. Returns True in
    the factory (the child's pid is written to ``reply``, its exit status to ``reply``.exit
    when it ends); in the child returns False, its output now going to ``log``, and the caller
    goes on to become the learner."""
    from common.lifecycle import die_with_parent
    orders = json.loads(line)
    reply = Path(orders["reply"])
    global _FORKED
    sys.stdout.flush()
    sys.stderr.flush()
    factory = os.getpid()
    import gc
    gc.freeze()   # what the factory holds is never collected: the fork's collector skips it (no copy)
    pid = os.fork()
    if pid == 0:
        _FORKED = True
        die_with_parent(factory)
        fd = os.open(orders["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        return False
    forks[pid] = str(reply) + ".exit"
    write_atomic(reply, str(pid))
    print(json.dumps({"event": "learner.standby_forked", "pid": pid, "learner_id": orders.get("learner_id")}),
          flush=True)
    return True


def reap_forks(forks: dict[int, str]) -> None:
    """Collect the exit status of forked learners that ended (Popen's convention: -N for signal N)."""
    for pid in list(forks):
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done, status = pid, 9   # reaped elsewhere: SIGKILL is the best guess
        if done:
            write_atomic(Path(forks.pop(pid)), str(os.waitstatus_to_exitcode(status)))
