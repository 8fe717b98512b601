"""The hung-learner watchdog of ``ddloco up`` (real child processes, heartbeats given as data)."""
import sys
import time

from ddloco.cluster import Child
from ddloco.supervisor import Supervisor


def _supervisor(tmp_path):
    (tmp_path / "logs").mkdir()
    argv = lambda lid, index: [sys.executable, "-c", "import signal; signal.pause()"]  # noqa: E731
    slots = {"a": {"index": 0}, "b": {"index": 1}}
    sup = Supervisor(workdir=tmp_path, learner_argv=argv, slots=slots, steps=0)
    for lid in slots:
        sup.add(Child(lid, argv(lid, 0), sup.log(lid)))
    return sup


def _beat(sup, lid, age_s, status="training"):
    c = next(c for c in sup.learners() if c.name == lid)
    return {"pid": str(c.pid), "updated_at": str(time.time() - age_s), "status": status}


def test_a_learner_frozen_across_a_redis_wipe_is_still_replaced(tmp_path):
    """Its entry was seen fresh, then Redis restarted empty: only the live learner re-registers.
    The frozen process is replaced once its last heartbeat seen is older than the limit."""
    sup = _supervisor(tmp_path)
    try:
        frozen = next(c for c in sup.learners() if c.name == "a")
        assert sup.replace_hung({"a": _beat(sup, "a", 0.5), "b": _beat(sup, "b", 0.1)}, 5.0, print) == []
        sup.last_beat["a"] = (frozen.pid, time.time() - 6.0, "training")   # as if 6 s went by
        assert sup.replace_hung({"b": _beat(sup, "b", 0.1)}, 5.0, print) == ["a"]  # "a" missing: Redis wiped
        assert sup.hung_replaced == 1 and frozen.wait(5.0) is not None
        new = next(c for c in sup.learners() if c.name == "a")
        assert new.pid != frozen.pid and new.alive()
    finally:
        for c in sup.children:
            c.kill()


def test_no_replacement_while_every_heartbeat_is_stale_or_the_learner_is_not_training(tmp_path):
    sup = _supervisor(tmp_path)
    try:
        assert sup.replace_hung({"a": _beat(sup, "a", 9), "b": _beat(sup, "b", 9)}, 5.0, print) == []  # Redis down?
        assert sup.replace_hung({"a": _beat(sup, "a", 9, "joining"), "b": _beat(sup, "b", 0.1)}, 5.0, print) == []
        assert sup.hung_replaced == 0 and all(c.alive() for c in sup.learners())
    finally:
        for c in sup.children:
            c.kill()


def test_a_learner_that_crashed_is_started_again_but_not_a_refused_or_killed_one(tmp_path):
    """Exit 1 (an exception, Redis gone too long): started again, at most CRASH_RESTARTS_MAX
    times. Exit 3 (refused) would be refused again; a signal is the chaos harness's to handle."""
    from ddloco.supervisor import CRASH_RESTARTS_MAX
    (tmp_path / "logs").mkdir()
    codes = {"crash": "1", "refused": "3"}
    argv = lambda lid, index: [sys.executable, "-c", f"raise SystemExit({codes.get(lid, 0)})"]  # noqa: E731
    slots = {"crash": {"index": 0}, "refused": {"index": 1}, "killed": {"index": 2}}
    sup = Supervisor(workdir=tmp_path, learner_argv=argv, slots=slots, steps=0)
    for lid in ("crash", "refused"):
        sup.add(Child(lid, argv(lid, 0), sup.log(lid)))
    killed = sup.add(Child("killed", [sys.executable, "-c", "import signal; signal.pause()"], sup.log("killed")))
    killed.proc.kill()
    try:
        for c in sup.learners():
            c.wait(10.0)
        restarted = []
        for _ in range(CRASH_RESTARTS_MAX + 2):
            restarted += sup.restart_crashed(print)
            for c in sup.learners():
                c.wait(10.0)
        assert restarted == ["crash"] * CRASH_RESTARTS_MAX
        assert sup.crash_restarts == {"crash": CRASH_RESTARTS_MAX}
        sup.halted = True   # the run is ending: nothing is started any more
        assert sup.restart_crashed(print) == []
    finally:
        for c in sup.children:
            c.kill()


def test_learners_that_crashed_twice_are_supervised_as_their_new_processes(tmp_path):
    """Every learner crashed (one Redis write can make them all fail at once): `up`'s loop pass
    starts them again and then looks at the new processes, so the run goes on; twice in a row."""
    (tmp_path / "logs").mkdir()
    flag = tmp_path / "crash"
    flag.write_text("")
    body = f"import os, signal, sys\nif os.path.exists({str(flag)!r}): sys.exit(1)\nsignal.pause()"
    argv = lambda lid, index: [sys.executable, "-c", body]  # noqa: E731
    slots = {"a": {"index": 0}, "b": {"index": 1}}
    sup = Supervisor(workdir=tmp_path, learner_argv=argv, slots=slots, steps=0)
    for lid in slots:
        sup.add(Child(lid, argv(lid, 0), sup.log(lid)))
    try:
        for crash in (1, 2):
            for c in sup.learners():
                assert c.wait(10.0) == 1
            if crash == 2:
                flag.unlink()          # the second replacements stay up
            dead, learners = sup.check(print)
            assert dead == []
            assert sup.crash_restarts == {"a": crash, "b": crash}
            assert learners == sup.learners() and len(learners) == 2
            if crash == 2:
                assert all(c.alive() for c in learners), "the loop would end the run: every learner it sees is dead"
    finally:
        for c in sup.children:
            c.kill()


FACTORY = """
import json, select, signal, sys
from learner.launch import fork_learner as _fork_learner, reap_forks as _reap_forks
forks = {}
while True:
    _reap_forks(forks)
    if select.select([sys.stdin], [], [], 0.05)[0]:
        line = sys.stdin.readline()
        if not line:
            break
        if not _fork_learner(line, forks):     # the forked copy: becomes the learner named
            print("I am", json.loads(line)["learner_id"], flush=True)
            signal.pause()
"""


def test_a_killed_learner_is_replaced_by_a_fork_of_the_standby_factory_any_number_of_times(tmp_path):
    """The standby pool is one prepared process that forks a copy per failure: each fork writes
    to the learner's log, is killable by its pid, its exit status reaches `up` through the factory,
    and forks end with their factory."""
    import os
    import signal
    from tests.conftest import wait_until
    sup = _supervisor(tmp_path)
    repo = str(__import__("pathlib").Path(__file__).resolve().parents[2])
    factory = Child("spare-1", [sys.executable, "-c", f"import sys; sys.path.insert(0, {repo!r})\n" + FACTORY],
                    sup.log("spare-1"), stdin=True)
    sup.spares, sup.spares_wanted = [factory], 1
    try:
        forked = []
        for round_ in range(3):    # three failures in a row: the factory serves each at once
            old = next(c for c in sup.learners() if c.name == "a")
            old.proc.kill()
            sup.restart("a")
            new = next(c for c in sup.learners() if c.name == "a")
            wait_until(lambda: new.pid is not None and new.log_tail(20 + round_).count("I am a") == round_ + 1, 10,
                       what="the forked learner running and writing to a's log")  # this fork's line, not the last one's
            assert new.alive() and new.pid not in (old.pid, factory.pid)
            forked.append(new)
        assert sup.spares_used == 3 and sup.spares == [factory] and factory.alive()
        assert sup.log("a").read_text().count("I am a") == 3
        os.kill(forked[-1].pid, signal.SIGKILL)
        assert forked[-1].wait(5.0) == -signal.SIGKILL    # reaped by the factory, reported to `up`
        assert all(c.wait(5.0) == -signal.SIGKILL for c in forked[:2])  # killed as each was replaced
        sup.restart("a")
        last = next(c for c in sup.learners() if c.name == "a")
        wait_until(lambda: last.pid is not None, 10, what="a fourth fork")
        factory.kill()
        wait_until(lambda: not last.alive(), 10, what="the fork ending with its factory")
        assert sup.restart_crashed(print) == ["a"]    # its slot is not left empty: started cold
        assert next(c for c in sup.learners() if c.name == "a").alive() and sup.spares == []
    finally:
        for c in sup.children + sup.spares:
            c.kill()
