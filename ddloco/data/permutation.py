"""A seeded permutation of ``range(n)`` in O(1) memory: a Feistel network with cycle walking.

    perm = Permutation(n, key=(seed, epoch))
    perm(np.array([0, 1, 2]))        # the images of positions 0, 1, 2 (distinct, all < n)

The network permutes the ``4**h`` integers of ``2*h`` bits (``4**h >= n``, so at most 4n): four
rounds, each ``L, R = R, L ^ F(R, round_key)`` on ``h``-bit halves, is a bijection whatever ``F`` is.
Cycle walking (apply it again while the image is >= n) restricts the bijection to ``range(n)``; as
the domain is less than 4n the expected number of walks is below 4. Nothing of size ``n`` is ever
built, so a corpus of billions of windows costs no memory to shuffle.
"""
from __future__ import annotations

import hashlib

import numpy as np

_ROUNDS = 4
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a fast, well-spread 64-bit hash (uint64 arithmetic wraps)."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


class Permutation:
    """A bijection of ``range(n)`` chosen by ``key`` (any tuple of ints, e.g. ``(seed, epoch)``)."""

    def __init__(self, n: int, key: tuple[int, ...]):
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1, got {n}")
        self.n = int(n)
        self.half_bits = max(1, ((self.n - 1).bit_length() + 1) // 2)
        self._mask = np.uint64((1 << self.half_bits) - 1)
        digest = hashlib.blake2b(repr(tuple(int(k) for k in key)).encode(), digest_size=8 * _ROUNDS).digest()
        self._round_keys = [np.uint64(int.from_bytes(digest[8 * r:8 * r + 8], "little")) for r in range(_ROUNDS)]

    def _network(self, x: np.ndarray) -> np.ndarray:
        shift = np.uint64(self.half_bits)
        left, right = x >> shift, x & self._mask
        for key in self._round_keys:
            left, right = right, left ^ (_mix(right ^ key) & self._mask)
        return (left << shift) | right

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """The images of ``positions`` (ints in ``range(n)``), as int64."""
        x = np.asarray(positions, dtype=np.uint64).copy()
        if x.size and int(x.max()) >= self.n:
            raise ValueError(f"position {int(x.max())} is outside range({self.n})")
        todo = np.ones(x.shape, dtype=bool)
        while todo.any():  # cycle walking: re-apply until the image falls inside range(n)
            x[todo] = self._network(x[todo])
            todo = x >= np.uint64(self.n)
        return x.astype(np.int64)
