"""Checkpoints of a shard: {Θ, momentum, version, next round} of every owned fragment, written
atomically off the loop (``common.files.atomic_path(durable=True)``: temp file, fsync, rename,
fsync of the directory), and loaded at start.

When: ``checkpoint_due`` after each merge (a fragment ``checkpoint_every_merges`` - 1 versions
past its checkpoint, or ``checkpoint_interval_s`` with any merge), and at stop.

The journal: a small file next to the checkpoint with every owned fragment's version, written
(atomically, durably, on a writer thread of its own) once a fragment is ``JOURNAL_EVERY`` versions
past it. A restarted shard that loaded its checkpoint but finds no record in Redis (restarted
empty) bounds the copies one learner alone may give it by the journal (``lone_limit``), not by
the checkpoint's age: full checkpoints can be rare (each one writes every fragment's Θ and
master: 400 MB a shard at 10^8 parameters) without a restart refusing the learners' copies of
the versions merged since.

Ownership: ``Checkpointing`` runs on the shard's loop thread (``_ckpt_versions``: the newest
snapshot's versions; ``_ckpt_saved_versions``: those of the file on disk). The writer thread
(``LatestWriter``) gets each checkpoint as a state dict (references to tensors no one writes in
place) and reads nothing of the live shard; it reports each outcome as a message
(``_ckpt_outcomes``) that the loop counts into ``stats.checkpoints`` / ``stats.checkpoint_errors``
and the cost counters (``_count_checkpoints``).
"""
from __future__ import annotations

import json
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from common import positions, tokens as run_count
from common.files import atomic_path

try:
    from torch.utils.serialization import config as torch_save_config
except ImportError:    # an older torch: its records always carry a CRC32
    torch_save_config = None


class LatestWriter:
    """One background thread that writes the newest submitted item; an item submitted while
    another is being written replaces any item still waiting (intermediate ones are skipped)."""

    def __init__(self, write: Callable[[Any], None], *, name: str) -> None:
        self._write = write
        self._name = name
        self._pending_cond = threading.Condition()
        """Guards ``_pending`` and ``_busy`` (the loop submits, the writer thread takes)."""
        self._pending: Any = None
        self._busy = False
        self._thread: threading.Thread | None = None

    def submit(self, item: Any) -> None:
        with self._pending_cond:
            self._pending = item
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._pending_cond.notify()

    def _loop(self) -> None:
        while True:
            with self._pending_cond:
                while self._pending is None:
                    self._pending_cond.wait()
                item, self._pending, self._busy = self._pending, None, True
            try:
                self._write(item)
            except Exception:  # the writer logs its own failures; the thread must outlive one
                pass
            finally:
                with self._pending_cond:
                    self._busy = False
                    self._pending_cond.notify_all()

    def close(self) -> None:
        """Wait until nothing is pending or being written; submitted items are written, not lost."""
        with self._pending_cond:
            while self._pending is not None or self._busy:
                self._pending_cond.wait()


@dataclass(frozen=True)
class CheckpointOutcome:
    """What the writer thread reports of one checkpoint (the loop counts it: ``_count_checkpoints``)."""

    written: bool
    cpu_s: float = 0.0
    """The writer thread's CPU seconds for it (``time.thread_time``)."""
    wall_s: float = 0.0
    nbytes: int = 0
    versions: dict[int, int] = field(default_factory=dict)
    """The fragments' versions in it (on disk once ``written``)."""


LEGACY_EVERY_MERGES = 20
"""``checkpoint_every_merges`` of a checkpoint file that does not record it (written before 2026-11-28)."""

JOURNAL_EVERY = 5
"""The journal is written once a fragment is this many versions past the journal on disk."""

JOURNAL_SLACK = 20
"""A restarted shard that lost Redis's record adopts a copy one learner alone holds up to the
journal's version of that fragment + this: a journal written every ``JOURNAL_EVERY`` versions
is behind the fragment by less, unless a write takes longer than three more writes' worth of
merges (``lone_limit``)."""


def lone_limit(*, recorded: int, checkpoint: int, journal: int | None, every_merges: int) -> int:
    """The newest version of a fragment a restarted shard that loaded its checkpoint adopts from
    one learner alone: the larger of the run's record in Redis (which may lag, or be lost) and the
    journal's version + ``JOURNAL_SLACK`` (never below the checkpoint's); with no journal (a shard
    directory from before it, or a journal lost or ignored) the checkpoint's version +
    ``every_merges``, the bound the checkpoint was written under."""
    if journal is None:
        return max(recorded, checkpoint + every_merges)
    return max(recorded, max(journal, checkpoint) + JOURNAL_SLACK)


def checkpoint_due(*, advanced: int, merges_since: int, since_last_s: float, every_merges: int,
                   interval_s: float) -> str | None:
    """Why a merge that left its fragment ``advanced`` versions past its version in the newest
    checkpoint calls for another one (None: it does not).

    "versions": ``advanced`` reached ``every_merges`` - 1: a write started one version early leaves
    that fragment one more merge before it lands and still within ``every_merges`` of the file
    (at ``every_merges`` = 1 every merge writes, with no such margin). That many versions are what
    a restart can lose where no learner holds a copy; one learner's copy is taken back up to the
    journal's bound (``lone_limit``), or, with no journal in the directory, up to the checkpoint's
    version + ``every_merges`` (``syncer.recovery``). Counted per fragment, not over the shard's
    merges: a shard of 12 fragments merging in turn writes its state about 12 × less often than
    after every ``every_merges`` of its merges.
    "interval": ``interval_s`` passed since the newest checkpoint with a merge since (a slow run)."""
    if advanced >= max(1, every_merges - 1):
        return "versions"
    if merges_since > 0 and since_last_s >= interval_s:
        return "interval"
    return None


def save_state(state: dict[str, Any], path: Path) -> None:
    """``torch.save`` without a CRC32 per zip record: ``torch.load`` does not check them (nor does
    ``ddloco export``; the values' digests do, ``save_checkpoint_file``), so they protected nothing, and computing them was most of the writer
    thread's CPU (a 200 MB state: 0.19 s with them, 0.05 s without, the least of 8 writes each).
    Atomicity and durability are ``atomic_path``'s (fsync, rename). The setting is the calling
    thread's only (torch's config patches are thread-local); ``unzip -t`` calls the records damaged."""
    if torch_save_config is None:
        torch.save(state, path)
        return
    with torch_save_config.patch({"save.compute_crc32": False}):
        torch.save(state, path)


class CheckpointMismatch(RuntimeError):
    """The checkpoint on disk belongs to another run config or shard layout, or is damaged."""


def values_digest(t: torch.Tensor) -> str:
    """A digest of a contiguous tensor's bytes against storage corruption (not an adversary: the
    checkpoint directory is the operator's): the sum and the xor of its 64-bit words, two passes
    at memory speed, where torch.save's zip CRC costs 2-3 × the write itself and torch.load never
    checks it. Any change of one word changes the sum."""
    raw = t.detach().contiguous().view(-1).view(torch.uint8).numpy()
    words = np.frombuffer(raw[:raw.size - raw.size % 8].data, dtype=np.uint64)
    tail = int.from_bytes(raw[raw.size - raw.size % 8:].tobytes(), "little")
    total = (int(np.add.reduce(words, dtype=np.uint64)) + tail) % (1 << 64)
    return f"{total:016x}{int(np.bitwise_xor.reduce(words)) if words.size else 0:016x}{raw.size:x}"


def _digests(state: dict[str, Any]) -> dict[str, str]:
    """``values_digest`` of every fragment's theta and master ("p/name")."""
    return {f"{p}/{name}": values_digest(fs[name]) for p, fs in state["fragments"].items()
            for name in ("theta", "master") if name in fs}


def save_checkpoint_file(state: dict[str, Any], path: Path) -> int:
    """``state`` with its values' digests to ``path``, atomically and durably
    (``common.files.atomic_path``), by ``save_state`` (no zip CRC: ``values_digest`` instead); its bytes."""
    state = {**state, "digests": _digests(state)}
    with atomic_path(path, durable=True) as tmp:
        save_state(state, tmp)
        return Path(tmp).stat().st_size


def load_checkpoint_file(path: Path) -> dict[str, Any]:
    """A shard checkpoint, its values checked against their digests (a checkpoint written before
    digests is taken as it is); ``CheckpointMismatch`` naming the first value that differs."""
    state = torch.load(path, weights_only=True)
    recorded = state.get("digests") or {}
    for key, digest in _digests(state).items():
        if key in recorded and recorded[key] != digest:
            raise CheckpointMismatch(f"checkpoint {path} is damaged: fragment {key} does not match its digest; "
                                     "move it away (the shard then recovers from the learners' copies)")
    return state


class Checkpointing:
    """The checkpoint steps of ``Shard`` (a mixin: the loop thread's state is the shard's)."""

    @property
    def checkpoint_path(self) -> Path | None:
        if not self.options.checkpoint_dir:
            return None
        name = f"{self.endpoints.run_id}-shard{self.options.shard}of{self.options.shards}.pt"
        return Path(self.options.checkpoint_dir).absolute() / name

    @property
    def journal_path(self) -> Path | None:
        """The journal of the fragments' versions, next to the checkpoint (None: no checkpoints)."""
        path = self.checkpoint_path
        return None if path is None else path.with_suffix(".versions.json")

    def _journal_identity(self) -> dict[str, Any]:
        return {"format": 1, "run_digest": self.run.digest(), "plan_digest": self.plan_digest,
                "shard": self.options.shard, "shards": self.options.shards}

    def _journal_after_merge(self, p: int, version: int) -> None:
        """On the loop, after fragment p merged into (or recovered at) ``version``: the journal once
        p is ``JOURNAL_EVERY`` past it."""
        if version - self._journal_versions.get(p, 0) >= JOURNAL_EVERY:
            self._journal_now()        # (nothing without a checkpoint directory)

    def _journal_now(self) -> None:
        """On the loop: every fragment's version to the journal's writer (a few hundred bytes; the
        newest replaces one still waiting). A fragment's entry never goes back: one still
        recovering keeps the version the journal gave it until its copy is in."""
        if self.journal_path is None:
            return
        self._journal_versions = {q: max(f.version, self._journal_versions.get(q, 0)) for q, f in self.frags.items()}
        self._journal_writer.submit({**self._journal_identity(), "epoch": self.epoch,
                                     "versions": {str(q): v for q, v in self._journal_versions.items()}})

    def _write_journal(self, entry: dict[str, Any]) -> None:
        """On the journal's writer thread: atomically and durably; a failure is logged (the next
        one is written at a fragment's next ``JOURNAL_EVERY`` versions). Nothing once the shard
        lost its lease: its fragments' journal is the new owner's."""
        path = self.journal_path
        assert path is not None
        if self._lease_lost:
            return
        try:
            with atomic_path(path, durable=True) as tmp:
                Path(tmp).write_text(json.dumps(entry, sort_keys=True))
        except OSError as e:
            self.log.error("syncer.journal_failed", path=str(path), error=str(e))

    def _journal_entry(self, path: Path) -> dict[str, Any]:
        """The journal at ``path``, this shard's (run, layout, format); ``ValueError`` otherwise
        (``RecursionError``, ``OSError`` as reading raises them)."""
        entry = json.loads(path.read_text())
        own = self._journal_identity()     # journals exist since the run digest they carry
        if not isinstance(entry, dict) or any(entry.get(k) != v for k, v in own.items()):
            raise ValueError("another run config, shard layout or format")
        return entry

    def _read_journal(self) -> dict[int, int] | None:
        """The journal's versions of the owned fragments (None: none, or not this shard's run and
        layout, or malformed: logged, and the checkpoint's bound applies)."""
        path = self.journal_path
        if path is None or not path.exists():
            return None
        try:
            versions = {int(q): v for q, v in self._journal_entry(path)["versions"].items()}
            if not all(type(v) is int for v in versions.values()):
                raise ValueError("versions must be integers")
            if any(v < 0 for v in versions.values()) or not set(versions) <= set(self.frags):
                raise ValueError("versions of fragments this shard does not own, or negative")
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            self.log.warning("syncer.journal_ignored", path=str(path), error=str(e))
            return None
        return versions

    def checkpoint(self, *, wait: bool = False, reason: str = "stop") -> None:
        """Snapshot {Θ, momentum, version, next_round} of every fragment (references to tensors no
        merge writes in place: no copy, no extra memory) and hand it to the writer thread, which
        writes it atomically (temp file, fsync, rename, fsync of the directory) off the loop. A
        snapshot taken while the previous one is still being written replaces any snapshot still
        waiting (the newest one wins).
        ``wait``: write synchronously after the writer finished (the final checkpoint at stop).
        ``reason``: why (``checkpoint_due``'s, or "stop"), logged with the write."""
        if self.checkpoint_path is None:
            return
        state = {
            "format": 2, "run_digest": self.run.digest(), "run_config": self.run.to_dict(),
            "plan_digest": self.plan_digest, "shard": self.options.shard, "shards": self.options.shards,
            "epoch": self.epoch,
            # references, not copies: a fragment's tensors are replaced by every merge, never
            # written in place (FragmentState), so the snapshot stays at its versions meanwhile
            "fragments": {p: {"theta": f.theta, "momentum": f.momentum, "version": f.version,
                              "next_round": f.next_round,
                              **({} if f.master is None else {"master": f.master})}
                          for p, f in self.frags.items()},
            "merges": self.stats.merges, "saved_at": time.time(), "run_tokens": self.run_tokens,
            "token_shares": dict(self.token_shares), "data_positions": dict(self.data_positions),
            # lock-step: who finished and left, which a restart with Redis lost too reads nowhere else
            "departed": sorted(self._departed),
            # the bound this file was written under: a restart without a journal takes a lone copy up to it
            "every_merges": self.options.checkpoint_every_merges,
            "reason": reason,
        }
        self._merges_since_ckpt = 0
        self._ckpt_versions = {p: f.version for p, f in self.frags.items()}
        self._ckpt_at = self.clock()
        if wait:
            self._ckpt_writer.close()
            self._write_checkpoint(state)
            self._count_checkpoints()
        else:
            self._ckpt_writer.submit(state)

    def _write_checkpoint(self, state: dict[str, Any]) -> None:
        """Atomic and durable (``common.files.atomic_path``). Runs on the writer thread (or at
        stop): it reads nothing of the live shard state and reports its outcome as a message."""
        path = self.checkpoint_path
        assert path is not None
        t0, cpu0 = time.perf_counter(), time.thread_time()
        try:
            nbytes = save_checkpoint_file(state, path)
        except (OSError, RuntimeError) as e:  # disk full, directory gone: keep merging, the old one stays intact
            self._ckpt_outcomes.put(CheckpointOutcome(False, time.thread_time() - cpu0, time.perf_counter() - t0))
            self.log.error("syncer.checkpoint_failed", path=str(path), error=str(e))
            return
        versions = {p: fs["version"] for p, fs in state["fragments"].items()}
        outcome = CheckpointOutcome(True, time.thread_time() - cpu0, time.perf_counter() - t0, nbytes, versions)
        self._ckpt_outcomes.put(outcome)
        self.log.info("syncer.checkpoint", path=str(path), reason=state.get("reason"), write_s=round(outcome.wall_s, 4),
                      cpu_s=round(outcome.cpu_s, 4), bytes=nbytes, versions=versions)

    def _count_checkpoints(self) -> None:
        """On the loop: count the writes the writer thread reported (written, failed). After a
        failed one the fragments count from the file on disk again, so the next merge of one
        that is ``checkpoint_every_merges`` - 1 past it writes again (not that many versions later)."""
        while True:
            try:
                outcome = self._ckpt_outcomes.get_nowait()
            except queue.Empty:
                return
            self.stats.checkpoint_cpu_s += outcome.cpu_s
            self.stats.checkpoint_write_s += outcome.wall_s
            if outcome.written:
                self.stats.checkpoints += 1
                self.stats.checkpoint_bytes += outcome.nbytes
                self._ckpt_saved_versions.update(outcome.versions)
            else:
                self.stats.checkpoint_errors += 1
                self._ckpt_versions = dict(self._ckpt_saved_versions)

    def _checkpoint_epoch(self) -> int:
        """The epoch recorded in this shard's checkpoint (0: none, or unreadable)."""
        path = self.checkpoint_path
        if self.options.fresh or path is None or not path.exists():
            return 0
        try:
            return int(torch.load(path, weights_only=True).get("epoch", 0))
        except Exception:  # a damaged file is reported by _load_checkpoint
            return 0

    def _journal_epoch(self) -> int:
        """The epoch recorded in this shard's journal (0: none, another run's or layout's, or
        unreadable): a life that crashed before its first checkpoint wrote its epoch there at start."""
        path = self.journal_path
        if self.options.fresh or path is None or not path.exists():
            return 0
        try:
            epoch = self._journal_entry(path).get("epoch", 0)
        except (OSError, ValueError, RecursionError):
            return 0
        return epoch if type(epoch) is int and epoch >= 0 else 0

    def _load_checkpoint(self) -> bool:
        path = self.checkpoint_path
        if path is None or not path.exists():
            return False
        state = load_checkpoint_file(path)
        if (state.get("run_digest") not in {self.run.digest(), *self.run.legacy_digests()}
                or state.get("plan_digest") != self.plan_digest):
            raise CheckpointMismatch(f"checkpoint {path} belongs to another run config; move it away or use another --checkpoint-dir")
        if (state["shard"], state["shards"]) != (self.options.shard, self.options.shards):
            raise CheckpointMismatch(f"checkpoint {path} is for shard {state['shard']} of {state['shards']}")
        for p, fs in state["fragments"].items():
            f = self.frags[int(p)]
            f.theta, f.momentum, f.version = fs["theta"], fs["momentum"], int(fs["version"])
            self._ckpt_versions[int(p)] = self._ckpt_saved_versions[int(p)] = f.version
            f.master, f.reply = fs.get("master"), None
            f.history = {f.version: f.theta}  # answers on older bases are refused as stale
            f.next_round = int(fs["next_round"])
        self.stats.merges = int(state.get("merges", 0))
        self.run_tokens = int(state.get("run_tokens", 0))
        self._since_unknown_unix = float(state.get("saved_at", self._since_unknown_unix))
        # a checkpoint from before shares existed holds the total only: one share of it
        self.token_shares = run_count.merge_shares(state.get("token_shares") or {},
                                                   {} if "token_shares" in state or not self.run_tokens
                                                   else {run_count.EARLIER: self.run_tokens})
        self.data_positions = positions.raised({}, (state.get("data_positions") or {}).items())
        every = state.get("every_merges", LEGACY_EVERY_MERGES)
        self._ckpt_every = every if type(every) is int and every >= 1 else LEGACY_EVERY_MERGES
        departed = state.get("departed") or []
        if isinstance(departed, list) and all(isinstance(d, str) for d in departed):
            self._departed = set(departed)       # one live again is dropped at the next refresh
        else:
            self.log.warning("syncer.checkpoint_bad_departed", path=str(path), detail="ignored")
        self.log.info("syncer.resumed", path=str(path), versions={p: f.version for p, f in self.frags.items()})
        return True

