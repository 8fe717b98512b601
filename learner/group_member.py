"""The learner as one rank of a torchrun group (learner/group.py has the group's collectives):
rank 0 leads (it alone talks to Redis and the broker), the other ranks follow, and at every step
boundary the group agrees on what happens next.

``GroupMember`` is a part of ``Learner`` (learner/core.py); everything here runs on the training
thread of its rank. Its own state: ``_changed`` (fragments rank 0 changed since the last
boundary), ``_deferred``/``_deferring``/``_gathered`` (a sharded group's merges wait for the
boundary), ``_group_run_tokens``, ``_sharding``, ``_trained_rss_mb``.
"""
from __future__ import annotations

from typing import Any

import torch

from common.fragments import state_tensors
from common.lifecycle import peak_rss_mb, rss_mb
from common.log import get_logger
from learner.group import params_digest, rank_stream
from learner.stats import LearnerSummary


class GroupMember:
    """A rank's part of the learner; see the module docstring."""

    def _init_group_member(self) -> None:
        self._changed: dict[int, torch.Tensor] = {}
        """In a group, rank 0's fragments changed since the last step boundary (the values it
        applied: scattered into its own tensors, or in a sharded group sent to every shard)."""
        self._group_run_tokens = 0.0
        self._sharding = "ddp"
        """In a group: "ddp" (every rank holds the whole model) or "fsdp" (rank 0 decides, at join)."""
        self._deferred: list[Any] = []
        self._gathered: dict[int, torch.Tensor] | None = None
        """Rank 0 of a sharded group while it trains: merges that arrived wait for the step
        boundary (``_deferred``), where the group gathers the fragments rank 0 needs whole
        (``_gathered``: p → flat value, updated as merges are applied); None between boundaries."""
        self._deferring = False
        self._trained_rss_mb = 0.0

    def _lead_group(self) -> None:
        """Rank 0, prepared: join the group and tell the other ranks what they cannot read
        themselves (the run config, data stream and position, the schedule's token count)."""
        g = self.group
        self._group_run_tokens = self.run_tokens()
        g.share({"run": self.run_cfg.to_dict(), "learner_id": self.id, "stream": self.stream,
                 "data_position": self.data_position, "run_tokens": self._group_run_tokens,
                 "sharding": self._sharding})
        self.log.info("learner.group", ranks=g.world, backend=g.backend, device=str(self.device),
                      sharding=self._sharding)

    def _follow(self) -> LearnerSummary:
        """A rank other than 0: no Redis, no sockets. Build the same model, take rank 0's
        fragments, then train in step with it; merged fragments arrive at step boundaries."""
        from common.config import run_config_from_dict
        from learner.receipt import Receipt
        g = self.group
        g.start(self._resolve_device())                # its type picks the backend, as on rank 0
        info = g.share()
        if "abort" in info:                            # rank 0 was refused or failed to join
            self.log.info("learner.group_aborted", rank=g.rank, reason=info["abort"])
            g.close()
            return self._summary(versions=False)
        self.id = str(info["learner_id"])
        self.log = get_logger("learner", learner=self.id, run=self.endpoints.run_id, rank=g.rank)
        self._prepare(run_config_from_dict(info["run"]))
        self.stream = rank_stream(int(info["stream"]), g.rank)
        self.data_position = int(info["data_position"])
        self._group_run_tokens = float(info["run_tokens"])
        self._sharding = str(info["sharding"])
        self.receipt = Receipt(len(self.plan), carry=False)   # its counters only: rank 0 receives
        g.share_changed(self.plan, self.tensors, {})
        try:
            self._train_steps()
            self._group_trained()
        finally:
            self.status = "stopped"
            g.close()
        return self._summary(versions=False)

    def _shard_for_training(self) -> None:
        """A sharded group before its first step: the parameters are DTensors now (each rank's
        shard); rank 0 defers merges to the step boundaries."""
        group = self.group
        self.tensors = state_tensors(self.model)
        self._deferring = group.leader
        held = sum(t.to_local().numel() if hasattr(t, "to_local") else t.numel() for t in self.tensors.values())
        self.log.info("learner.group_sharded", rank=group.rank, holds=held,
                      of=sum(t.numel() for t in self.tensors.values()))

    def _group_boundary(self, *, stop: bool, done: bool, skip: bool, tokens: int, min_steps: int
                        ) -> tuple[bool, bool, bool, int]:
        """The group agrees: stop, budget, barrier, tokens, merged fragments (also at the last
        boundary: merges drained this iteration reach every rank). Returns (stop, done, skip, tokens)."""
        group, leader = self.group, self.group.leader
        want = self._wanted_whole(min_steps, answers=not (stop or done)) if self._deferring else ()
        b = group.boundary(fragments=len(self.plan), stop=stop, done=done, skip=skip, tokens=tokens,
                           run_tokens=self.run_tokens() if leader else 0.0, changed=self._changed, gather=want)
        if b.gather:        # a sharded group's second phase (learner/group.py)
            self._gathered = group.gather_fragments(self.plan, self.tensors, b.gather)
            try:
                if leader:   # the last boundary applies merges; the flush answers after it
                    self._apply_deferred(min_steps, answer=not (b.stop or b.done))
            finally:
                self._gathered = None
            group.share_changed(self.plan, self.tensors, self._changed)
        else:
            group.share_fragments(self.plan, self.tensors, self._changed, b.changed)
        self._changed.clear()
        self._group_run_tokens = b.run_tokens
        return b.stop, b.done, b.skip, b.tokens

    def _wanted_whole(self, min_steps: int, *, answers: bool = True) -> list[int]:
        """Rank 0 of a sharded group, before a boundary: the fragments it will need whole there
        (merges to apply; with ``answers``, rounds it may answer)."""
        want = {item.fragment for item in self._deferred}
        if answers:
            rc = self.receipt
            want.update(p for p, o in rc.pending_open.items() if rc.answerable(p, o, min_steps))
        return sorted(want)

    def _apply_deferred(self, min_steps: int, *, answer: bool = True) -> None:
        """Rank 0 of a sharded group, at a boundary with the wanted fragments gathered: apply the
        merges that arrived, then (``answer``) answer the open rounds (after them, as without
        sharding)."""
        deferred, self._deferred = self._deferred, []
        for item in deferred:
            self._apply(item)
        if answer:
            self._answer_open_rounds(min_steps)

    def _group_trained(self) -> None:
        """Every rank, after its last step: a sharded group gathers the whole model (a collective,
        at the same point on every rank), then each rank logs what it trained and cost."""
        g = self.group
        self._trained_rss_mb = rss_mb()
        if g.sharded:
            self.tensors = g.materialize(self.model)
        self.log.info("learner.group_trained", rank=g.rank, ranks=g.world, steps=self._stats.steps,
                      params_digest=params_digest(self.tensors), **self._rank_figures())

    def _rank_figures(self) -> dict[str, Any]:
        """What one rank of a group cost: its training time, peak RSS (MB), RSS at the end of
        training (before a sharded group gathers the whole model), and on CUDA the device's peak
        allocated memory (MB)."""
        out: dict[str, Any] = {"train_s": round(self._stats.train_s, 3), "peak_rss_mb": peak_rss_mb(),
                               "trained_rss_mb": self._trained_rss_mb, "sharding": self._sharding,
                               "fragments_shared": self.group.shared if self.group is not None else 0}
        if self.device.type == "cuda":
            out["peak_device_mb"] = round(torch.cuda.max_memory_allocated(self.device) / 2**20, 1)
        return out
