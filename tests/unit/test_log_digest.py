"""The digest of the daemons' warnings and errors that `ddloco up` prints at its end."""
from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from ddloco.logs import LogCounts, count_problems, daemon_name, digest_lines, print_digest, read_digest

pytestmark = pytest.mark.timeout(30)


def line(event: str, level: str, **fields) -> str:
    """A log line as a daemon writes it (structlog's JSONRenderer)."""
    return json.dumps({"component": "syncer", "shard": 0, "run": "demo", **fields, "event": event, "level": level,
                       "timestamp": "2026-11-26T06:32:58.338014Z"})


SHARD_LOG = [
    line("syncer.started", "info", fragments=[0, 1]),
    line("syncer.answer_rejected", "warning", reason="steps_claim", learner="learner-2"),
    line("syncer.answer_rejected", "warning", reason="clipped", learner="learner-0"),
    line("syncer.rounds_behind", "warning", fragment=3),
    line("syncer.answer_rejected", "warning", reason="clipped", learner="learner-2"),
    line("syncer.insecure", "warning", detail="--insecure: ZeroMQ traffic is neither authenticated nor encrypted"),
    line("syncer.redis_lost", "error", error="Connection refused"),
    line("syncer.checkpoint_failed", "critical"),
    "Traceback (most recent call last):",
    '  File "x.py", line 1, in <module>: "warning" "error"',
    '{"not": "a log line", "level": "warning"',
    "[]",
]


def test_warning_and_error_lines_are_counted_by_event_and_everything_else_is_skipped():
    counts = count_problems(SHARD_LOG)
    assert counts["warning"] == Counter({"syncer.answer_rejected": 3, "syncer.rounds_behind": 1})
    assert counts["error"] == Counter({"syncer.redis_lost": 1, "syncer.checkpoint_failed": 1})   # critical: error


def test_the_digest_names_each_daemon_its_top_events_and_its_log():
    log = Path("runs/demo-1f9a3c-20261126-063254/logs/syncer-0.log")
    counts = count_problems(SHARD_LOG)
    shard = LogCounts(daemon_name(log), log, counts["warning"], counts["error"])
    quiet = LogCounts("learner-0", log.with_name("learner-0.log"), Counter(), Counter())
    assert digest_lines([quiet, shard], "warning") == [
        "warnings   shard0: syncer.answer_rejected x3, syncer.rounds_behind x1 "
        "(runs/demo-1f9a3c-20261126-063254/logs/syncer-0.log)"]
    assert digest_lines([quiet, shard], "error") == [
        "errors     shard0: syncer.redis_lost x1, syncer.checkpoint_failed x1 "
        "(runs/demo-1f9a3c-20261126-063254/logs/syncer-0.log)"]
    assert digest_lines([quiet], "warning") == []


def test_the_digest_is_short_the_most_warned_daemon_first():
    many = Counter({f"learner.event_{i}": 10 - i for i in range(5)})
    logs = [LogCounts(f"learner-{i}", Path(f"logs/learner-{i}.log"), Counter({"learner.slow": i + 1}), Counter())
            for i in range(10)] + [LogCounts("broker", Path("logs/broker.log"), many, Counter())]
    got = digest_lines(logs, "warning")
    assert got[0] == ("warnings   broker: learner.event_0 x10, learner.event_1 x9, learner.event_2 x8, +2 more "
                      "(logs/broker.log)")
    assert got[1] == "warnings   learner-9: learner.slow x10 (logs/learner-9.log)"
    assert len(got) == 9 and got[-1] == "warnings   and 3 more daemons (logs)"


def test_the_logs_of_a_run_are_read_and_printed_warnings_through_say_errors_on_stderr(tmp_path, capsys):
    (tmp_path / "syncer-1.log").write_text("\n".join(SHARD_LOG) + "\n")
    (tmp_path / "learner-0.log").write_text(line("learner.started", "info") + "\n")
    (tmp_path / "redis-6379.log").write_text("1:C 26 Nov 2026 06:57:27.309 # Redis is starting\n")
    assert [(lc.daemon, lc.path.name) for lc in read_digest(tmp_path)] == [
        ("learner-0", "learner-0.log"), ("redis-6379", "redis-6379.log"), ("shard1", "syncer-1.log")]
    said: list[str] = []
    print_digest(tmp_path, said.append)
    assert said == [f"warnings   shard1: syncer.answer_rejected x3, syncer.rounds_behind x1 ({tmp_path}/syncer-1.log)"]
    assert capsys.readouterr().err == (f"errors     shard1: syncer.redis_lost x1, syncer.checkpoint_failed x1 "
                                       f"({tmp_path}/syncer-1.log)\n")
    print_digest(tmp_path, lambda _: None)   # --quiet: the errors still
    assert capsys.readouterr().err.startswith("errors     shard1: ")
