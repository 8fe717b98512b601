"""The typed messages between a learner's threads (learner/core.py, learner/network.py).

    inbox  (network -> training):  FragmentArrived, RoundOpened, StateRequested,
                                   PeerStateWanted, PeerStateArrived
    outbox (training -> network):  Answer, Fetch, Have, PeerState, AskPeer

Every message is a frozen dataclass: once put, neither thread writes it (tensors in it are
values no thread writes afterwards).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class FragmentArrived:
    """Network -> training: a merged fragment (broadcast, or the reply to a Fetch). ``values`` is
    the full value when ``update_base`` is -1, else the update to add to version ``update_base``."""

    fragment: int
    epoch: int
    version: int
    values: torch.Tensor
    requested: bool
    update_base: int = -1
    on_device: Any = None
    """A CUDA learner: the full value already on its way to the device (``HostStaging.prefetch``,
    started by the network thread), which the training thread adopts instead of copying ``values``."""


@dataclass(frozen=True)
class RoundOpened:
    """Network -> training: round ``round`` of ``fragment`` is open at ``version``."""

    fragment: int
    epoch: int
    round: int
    attempt: int
    version: int


@dataclass(frozen=True)
class Answer:
    """Training -> network: a snapshot to answer a round with (delta computed off-thread)."""

    fragment: int
    epoch: int
    round: int
    attempt: int
    base: int
    base_values: torch.Tensor
    snapshot: torch.Tensor
    steps: int
    tokens: int
    ready: Any = None   # a CUDA learner's snapshot is complete once this event is (learner/staging.py)
    final: bool = False
    """Sent after the learner's last step (its flush): the shards open rounds without spacing meanwhile."""


@dataclass(frozen=True)
class StateRequested:
    """Network -> training: a (re)started shard asks for our copy of ``fragment``."""

    fragment: int


@dataclass(frozen=True)
class Have:
    """Training -> network: our base value of ``fragment`` (the merged value at ``version``)."""

    fragment: int
    epoch: int
    version: int
    values: torch.Tensor


@dataclass(frozen=True)
class Fetch:
    """Training -> network: ask the owning shards for the full current value of these fragments."""

    fragments: tuple[int, ...]


@dataclass(frozen=True)
class PeerStateWanted:
    """Network -> training: a joining learner asks for our state (answer at a step boundary)."""

    identity: bytes
    requester: str


@dataclass(frozen=True)
class PeerState:
    """Training -> network: our state snapshot for ``identity`` (None: not ready to serve)."""

    identity: bytes
    requester: str
    state: dict[str, Any] | None
    snapshot_s: float = 0.0


@dataclass(frozen=True)
class AskPeer:
    """Training -> network: ask the learner at ``endpoint`` for its state."""

    peer: str
    endpoint: str


@dataclass(frozen=True)
class PeerStateArrived:
    """Network -> training: the state a peer sent (None: it could not serve)."""

    peer: str
    state: dict[str, Any] | None
    nbytes: int
    error: str = ""
