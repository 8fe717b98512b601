"""Which windows each data stream reads: the corpus dealt into disjoint, seeded streams per epoch.

The train split is cut into ``n`` windows. Epoch ``e`` orders them by ``Permutation(n, (seed, e))``;
stream ``s`` of ``S`` reads the permuted positions ``q, q+S, q+2S, ...`` (``q = s mod S``), so the
``S`` streams together read every window exactly once per epoch and never the same one. When its
part is exhausted a stream goes on into the next epoch (a new permutation). Read number ``k`` of a
stream is therefore a closed formula: batch ``i`` (reads ``i*B .. i*B+B-1``) costs O(B), whatever
``i`` is. A corpus with fewer windows than streams deals to ``n`` streams (``s mod n``).
"""
from __future__ import annotations

import functools

import numpy as np

from ddloco.data.permutation import Permutation


@functools.lru_cache(maxsize=64)
def _permutation(n: int, seed: int, epoch: int) -> Permutation:
    return Permutation(n, (seed, epoch))


def stream_share(n_windows: int, streams: int, stream: int) -> tuple[int, int, int]:
    """(q, S, windows per epoch) of ``stream``: it reads positions q, q+S, ... of each epoch."""
    if n_windows < 1:
        raise ValueError("no windows to deal")
    if streams < 1 or stream < 0:
        raise ValueError(f"streams must be >= 1 and stream >= 0, got streams={streams} stream={stream}")
    s_eff = min(streams, n_windows)
    q = stream % s_eff
    return q, s_eff, (n_windows - q + s_eff - 1) // s_eff


def stream_windows(n_windows: int, streams: int, stream: int, seed: int, start: int, count: int) -> np.ndarray:
    """The window ids (int64) of reads ``start .. start+count-1`` of ``stream``."""
    q, s_eff, per_epoch = stream_share(n_windows, streams, stream)
    reads = np.arange(start, start + count, dtype=np.int64)
    epochs, within = np.divmod(reads, per_epoch)
    positions = q + s_eff * within
    out = np.empty(count, dtype=np.int64)
    for epoch in np.unique(epochs):
        sel = epochs == epoch
        out[sel] = _permutation(n_windows, int(seed), int(epoch))(positions[sel])
    return out
