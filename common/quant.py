"""Wire codecs for flat fp32 vectors (ALGORITHM.md §7).

One encoder and its exact inverse per codec; the frame layout of every codec is written once,
here, and nowhere else:

========  ==========================================================  ==================
codec     frames                                                      bytes for n values
========  ==========================================================  ==================
fp32      [values float32]                                            4n
bf16      [values bfloat16, round to nearest even]                    2n
int8      [q int8 in [-127, 127]], [scales bf16, one per block]       n + 2*ceil(n/64)
int4      [q nibbles in [-7, 7]], [scales bf16, one per block]        ceil(n/2) + 2*ceil(n/64)
========  ==========================================================  ==================

int8/int4 use blockwise absmax scaling with ``BLOCK`` = 64 values per block:
``scale = bf16(absmax / L)`` with L = 127 (int8) or 7 (int4), ``q = clamp(round(x / scale),
-L, L)``, decoded as ``q * scale``. The scale is rounded to bf16 *before* quantising, so the
decoder multiplies by exactly the scale the encoder divided by. An all-zero block has scale 0
and decodes to zeros. int4 packs two values per byte, low nibble first, as 4-bit two's
complement; an odd count is padded with a zero nibble. Round to nearest, no error feedback.

Two implementations compute these bytes: ``common._qkernels``, a C extension that quantises and
packs (or unpacks and scales) in one pass over the values without holding the GIL, built by
``pip install`` where a C compiler is found; and the torch code below, used where it was not
built or when ``DDLOCO_KERNELS=torch`` is set. They produce identical payloads and identical
decoded values (tests/unit/test_quant.py compares them); ``KERNEL`` says which one this process
uses.

All integers are little-endian (the native order of every machine we run on). Frames are
``memoryview`` objects in byte format over freshly allocated arrays the caller owns, so they
can be handed to ``zmq.Socket.send_multipart(..., copy=False)`` without copying and are not
affected by later in-place changes of the input.
"""
from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from common import hostmem
from common.boundary import split_run

if sys.byteorder != "little":   # the frame layout and the int16 views of the nibble packing assume it
    raise ImportError("common.quant: the wire format is little-endian; this machine is big-endian")

CODECS: tuple[str, ...] = ("fp32", "bf16", "int8", "int4")
"""Codec names, in order of decreasing precision."""

BLOCK = 64
"""Values per absmax scaling block of the int8 and int4 codecs."""

_LEVELS: dict[str, int] = {"int8": 127, "int4": 7}
"""Largest quantisation level L of each blockwise codec (levels are -L..L)."""
_SCALE_LIMIT: dict[str, float] = {"int8": float(np.finfo(np.float32).max) / 128, "int4": float(np.finfo(np.float32).max) / 8}
"""The largest |scale| a payload may carry: its codes (|q| <= 128 for int8 read as a byte, 8 for int4)
times it stay finite in fp32 (the C kernels' ``scale_limit``)."""


KERNELS_ABI = 3
"""The version of ``common/_qkernels.c`` this code calls (its ``QKERNELS_ABI``): an extension
built from other sources (a checkout updated without ``pip install -e .``) is not used."""


def _load_kernels() -> Any:
    """The C kernels, or None (not built here, or ``DDLOCO_KERNELS=torch``)."""
    choice = os.environ.get("DDLOCO_KERNELS", "auto")
    if choice not in ("auto", "c", "torch"):
        raise ImportError(f"DDLOCO_KERNELS must be auto, c or torch, got {choice!r}")
    if choice == "torch":
        return None
    try:
        from common import _qkernels
        if getattr(_qkernels, "ABI", None) != KERNELS_ABI:   # built from older sources, not rebuilt
            raise ImportError(f"common._qkernels has ABI {getattr(_qkernels, 'ABI', None)}, "
                              f"expected {KERNELS_ABI}")
    except ImportError as e:
        if choice == "c":
            raise ImportError(f"DDLOCO_KERNELS=c but the C extension common._qkernels is not usable ({e}; "
                              "rebuild it with a C compiler: pip install -e .)") from None
        return None
    return _qkernels


_kernels = _load_kernels()
KERNEL: str = "c" if _kernels is not None else "torch"
"""Which implementation of the int8/int4 codecs this process uses: ``c`` or ``torch``."""


class CodecError(ValueError):
    """Unknown codec, invalid input vector, or frames that do not match the codec's layout."""


class NonFiniteError(CodecError):
    """Values (to encode, or decoded from a payload) that are NaN/inf, or int8/int4 scales so large
    that a decoded value would be: ``decode`` never returns a non-finite value."""


# --------------------------------------------------------------------------------------------
# sizes


def _check_codec(codec: str) -> None:
    if codec not in CODECS:
        raise CodecError(f"unknown codec {codec!r}; expected one of {CODECS}")


def _check_numel(numel: int) -> None:
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise CodecError(f"numel must be a non-negative int, got {numel!r}")


def _frame_nbytes(numel: int, codec: str) -> tuple[int, ...]:
    """Exact byte size of each frame ``encode`` produces for ``numel`` values."""
    if codec == "fp32":
        return (4 * numel,)
    if codec == "bf16":
        return (2 * numel,)
    n_blocks = math.ceil(numel / BLOCK)
    values = numel if codec == "int8" else math.ceil(numel / 2)
    return (values, 2 * n_blocks)


def payload_nbytes(numel: int, codec: str) -> int:
    """Total bytes of the frames ``encode`` returns for a vector of ``numel`` values."""
    _check_codec(codec)
    _check_numel(numel)
    return sum(_frame_nbytes(numel, codec))


# --------------------------------------------------------------------------------------------
# encode


def _as_frame(t: torch.Tensor) -> memoryview:
    """Byte-format memoryview over a CPU tensor's memory (bf16 goes through int16)."""
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return memoryview(t.numpy()).cast("B")


def _check_input(x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise CodecError(f"expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.float32:
        raise CodecError(f"expected a float32 tensor, got {x.dtype}")
    if x.dim() != 1:
        raise CodecError(f"expected a 1-D tensor, got shape {tuple(x.shape)}")
    if not x.is_contiguous():
        raise CodecError("expected a contiguous tensor")
    if x.device.type != "cpu":
        raise CodecError(f"expected a CPU tensor, got device {x.device}")


def _all_finite(t: torch.Tensor) -> bool:
    """True if a float32/bf16 CPU tensor holds no NaN/inf (numpy is the fastest check on CPU)."""
    if t.dtype == torch.bfloat16:       # numpy has no bf16: NaN/inf have all exponent bits set
        bits = t.detach().view(torch.int16).numpy()
        return not bool(((bits & 0x7F80) == 0x7F80).any())
    return bool(np.isfinite(t.detach().numpy()).all())


def _finite(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or ``CodecError`` if it holds NaN/inf."""
    if not _all_finite(t):
        raise NonFiniteError("non-finite values")
    return t


def _quantise_blocks(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blockwise absmax quantisation.

    Returns ``q`` (int8, padded length ``n_blocks * BLOCK``, zeros in the padding) and the bf16
    ``scales`` [n_blocks].
    """
    n = x.numel()
    n_blocks = math.ceil(n / BLOCK)
    if n == n_blocks * BLOCK:
        blocks = x.view(n_blocks, BLOCK)                              # [B, 64], not copied
    else:
        padded = x.new_zeros(n_blocks * BLOCK)
        padded[:n] = x
        blocks = padded.view(n_blocks, BLOCK)
    absmax = _finite(blocks.abs().amax(dim=1))                        # [B], NaN/inf propagate
    scales = (absmax / levels).to(torch.bfloat16)                     # [B]
    scales_f = scales.float()
    # An all-zero block has scale 0: divide by 1 instead (its values are 0 anyway). So does a
    # block whose absmax/L underflows bf16 (absmax below ~6e-39): it decodes to zeros.
    divisor = torch.where(scales_f > 0, scales_f, torch.ones_like(scales_f))
    q = torch.div(blocks, divisor.unsqueeze(1)).round_().clamp_(-levels, levels)   # a new tensor
    return q.view(-1).to(torch.int8), scales


def _pack_nibbles(q: torch.Tensor, n: int) -> torch.Tensor:
    """Pack int8 values in [-8, 7] two per byte, low nibble first: ceil(n/2) uint8 bytes."""
    n_bytes = math.ceil(n / 2)
    w = q[: 2 * n_bytes].view(torch.int16)        # one (low, high) pair per int16, little-endian
    return ((w & 0x0F) | ((w >> 4) & 0xF0)).to(torch.uint8)   # contiguous ops, not strided


def encode(x: torch.Tensor, codec: str) -> list[memoryview]:
    """Encode a 1-D contiguous float32 CPU vector into the codec's payload frames.

    Raises ``CodecError`` for an unknown codec, a tensor of the wrong kind, or NaN/inf values.
    """
    _check_codec(codec)
    _check_input(x)
    x = x.detach()
    if codec == "fp32":
        return [_as_frame(_finite(x).clone())]
    if codec == "bf16":   # checked after rounding: NaN/inf input, or overflow of the bf16 range
        return [_as_frame(_finite(x.to(torch.bfloat16)))]
    n = x.numel()
    if _kernels is not None:
        values_nbytes, scales_nbytes = _frame_nbytes(n, codec)
        values = np.empty(values_nbytes, dtype=np.uint8)
        scales = np.empty(scales_nbytes // 2, dtype=np.int16)
        if not _kernels.encode(x.numpy(), _LEVELS[codec], values, scales):
            raise NonFiniteError("non-finite values")
        return [memoryview(values), memoryview(scales).cast("B")]
    q, scales_bf16 = _quantise_blocks(x, _LEVELS[codec])
    values_t = q[:n] if codec == "int8" else _pack_nibbles(q, n)
    return [_as_frame(values_t), _as_frame(scales_bf16)]


# --------------------------------------------------------------------------------------------
# decode


def _as_bytes_view(frame: Any) -> memoryview:
    """Byte-format memoryview over bytes, a memoryview, a numpy array or a zmq.Frame."""
    try:
        view = memoryview(frame)
    except TypeError:
        buffer = getattr(frame, "buffer", None)   # zmq.Frame on builds without buffer protocol
        if buffer is None:
            raise CodecError(f"frame of type {type(frame).__name__} is not a buffer") from None
        view = memoryview(buffer)
    if not view.c_contiguous:
        raise CodecError("frame buffer is not contiguous")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _to_tensor(view: memoryview, dtype: np.dtype) -> torch.Tensor:
    """Copy a byte view into a new, writable, aligned tensor of the given numpy dtype."""
    return torch.from_numpy(np.frombuffer(view, dtype=dtype).copy())


def _dequantise_blocks(q: torch.Tensor, scales: torch.Tensor, n: int) -> torch.Tensor:
    """``q * scale`` per block; ``q`` is int8 of length >= n, scales bf16 [n_blocks]."""
    n_blocks = scales.numel()
    if n == n_blocks * BLOCK and q.numel() == n:
        out = q.to(torch.float32)
    else:
        out = torch.zeros(n_blocks * BLOCK, dtype=torch.float32)
        out[:n] = q[:n]
    out.view(n_blocks, BLOCK).mul_(scales.float().unsqueeze(1))
    return out[:n]


def _unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``_pack_nibbles``: uint8 [k] -> int8 [2k] in [-8, 7]."""
    w = packed.to(torch.int16)
    nibbles = ((w & 0x0F) | ((w & 0xF0) << 4)).view(torch.int8)    # [2k] in 0..15, low nibble first
    return (nibbles ^ 8) - 8                                       # sign-extend 4 bits


def decode(frames: Sequence[Any], codec: str, numel: int) -> torch.Tensor:
    """Decode payload frames into a new 1-D float32 tensor of length ``numel``.

    Every frame's length is checked exactly against the codec's layout; a wrong frame count,
    a wrong size or non-finite content raises ``CodecError``.
    """
    _check_codec(codec)
    _check_numel(numel)
    expected = _frame_nbytes(numel, codec)
    if len(frames) != len(expected):
        raise CodecError(f"codec {codec} expects {len(expected)} frame(s), got {len(frames)}")
    views = [_as_bytes_view(f) for f in frames]
    for i, (view, nbytes) in enumerate(zip(views, expected)):
        if view.nbytes != nbytes:
            raise CodecError(
                f"codec {codec} frame {i} for {numel} values must be {nbytes} bytes, "
                f"got {view.nbytes}"
            )
    if codec == "fp32":
        return _finite(_to_tensor(views[0], np.dtype("<f4")))
    if codec == "bf16":
        return _finite(_to_tensor(views[0], np.dtype("<i2")).view(torch.bfloat16)).float()
    if _kernels is not None:
        out = hostmem.empty(numel)
        if not _kernels.decode(views[0], views[1], _LEVELS[codec], out.numpy()):
            raise NonFiniteError("non-finite values")
        return out
    scales = _finite(_to_tensor(views[1], np.dtype("<i2")).view(torch.bfloat16))
    if scales.numel() and float(scales.float().abs().max()) > _SCALE_LIMIT[codec]:   # q * scale would overflow
        raise NonFiniteError("non-finite values")
    if codec == "int8":
        q = _to_tensor(views[0], np.dtype("i1"))
    else:
        q = _unpack_nibbles(_to_tensor(views[0], np.dtype("u1")))
    return _dequantise_blocks(q, scales, numel)


# --------------------------------------------------------------------------------------------
# a payload kept encoded (the shard's merge decodes it tile by tile: common.merge)


def _scales_in_range(scales: memoryview, codec: str) -> bool:
    """Every bf16 scale finite and within ``_SCALE_LIMIT`` (then every decoded value is finite)."""
    bits = np.frombuffer(scales, dtype="<u2").astype(np.uint32) << 16
    return bool((np.abs(bits.view(np.float32)) <= _SCALE_LIMIT[codec]).all())   # NaN fails too


@dataclass(frozen=True, eq=False)
class EncodedVector:
    """An int8/int4 payload of ``numel`` values, checked (sizes, scales: it decodes to finite
    values) but not decoded: 1/8 (int4) of the fp32 memory while it waits in a round. The merge
    kernels read it directly (``kernel_args``); ``vec[a:b]`` decodes values [a, b) only."""

    codec: str
    numel: int
    values: memoryview
    scales: memoryview

    def decode(self) -> torch.Tensor:
        return decode([self.values, self.scales], self.codec, self.numel)

    def kernel_args(self) -> tuple[memoryview, memoryview, int]:
        """(values, scales, levels) for ``_qkernels.round_*``."""
        return self.values, self.scales, _LEVELS[self.codec]

    def __getitem__(self, where: slice) -> torch.Tensor:
        a, b, step = where.indices(self.numel)
        if step != 1:
            raise CodecError("an encoded vector is sliced with step 1 only")
        if b <= a:
            return torch.empty(0, dtype=torch.float32)
        b0, b1 = a // BLOCK, -(-b // BLOCK)
        per_block = BLOCK // 2 if self.codec == "int4" else BLOCK
        count = min(b1 * BLOCK, self.numel) - b0 * BLOCK
        values = self.values[b0 * per_block:b0 * per_block + _frame_nbytes(count, self.codec)[0]]
        out = decode([values, self.scales[2 * b0:2 * b1]], self.codec, count)
        return out[a - b0 * BLOCK:b - b0 * BLOCK]


def encoded(frames: Sequence[Any], codec: str, numel: int) -> "EncodedVector | torch.Tensor":
    """``frames`` checked as ``decode`` checks them, kept encoded where the merge kernels can read
    them (int8/int4 with the C kernels built); otherwise decoded. Raises ``NonFiniteError`` for a
    payload that would decode to NaN/inf, ``CodecError`` for a malformed one."""
    if codec not in ("int8", "int4") or _kernels is None:
        return decode(frames, codec, numel)
    _check_codec(codec)
    _check_numel(numel)
    views = [_as_bytes_view(f) for f in frames]
    expected = _frame_nbytes(numel, codec)
    if len(views) != len(expected) or any(v.nbytes != nb for v, nb in zip(views, expected)):
        raise CodecError(f"codec {codec} frames for {numel} values must be {list(expected)} bytes, "
                         f"got {[v.nbytes for v in views]}")
    if not _scales_in_range(views[1], codec):
        raise NonFiniteError("non-finite values")
    return EncodedVector(codec, numel, views[0], views[1])


def _encode_pair(kernel: Any, a: torch.Tensor, b: torch.Tensor, codec: str, *out: Any) -> list[memoryview]:
    """The frames of ``kernel(a, b, levels, values, scales, *out)``: one of the C kernels that
    encode a − b in one pass (fp32 CPU vectors of one size); ``NonFiniteError`` if a − b holds NaN/inf."""
    for t in (a, b):
        _check_input(t)
    if a.numel() != b.numel():
        raise CodecError(f"the two vectors hold {a.numel()} and {b.numel()} values")
    values_nbytes, scales_nbytes = _frame_nbytes(a.numel(), codec)
    values = np.empty(values_nbytes, dtype=np.uint8)
    scales = np.empty(scales_nbytes // 2, dtype=np.int16)
    if not kernel(a.detach().numpy(), b.detach().numpy(), _LEVELS[codec], values, scales, *out):
        raise NonFiniteError("non-finite values")
    return [memoryview(values), memoryview(scales).cast("B")]


def encode_update(master: torch.Tensor, replica: torch.Tensor, codec: str) -> tuple[torch.Tensor, list[memoryview]] | None:
    """(replica + decode(encode(master − replica)), those frames) in one pass with the C kernels
    (int8/int4, fp32 CPU vectors): the bytes and values of the unfused expression. None where the
    kernels do not serve it; ``NonFiniteError`` if master − replica holds NaN/inf."""
    if codec not in ("int8", "int4") or _kernels is None:
        return None
    out = hostmem.empty_like(master)
    return out, _encode_pair(_kernels.encode_update, master, replica, codec, out.numpy())


# --------------------------------------------------------------------------------------------
# the learner's sync path: an answer's codes and a received update, one pass each


def _learner_kernel(name: str, codec: str) -> Any:
    """The C kernel ``name`` for an int8/int4 ``codec``, or None (another codec, the torch
    implementation, or an extension built before the learner's kernels were added to it)."""
    if codec not in _LEVELS or _kernels is None:
        return None
    return getattr(_kernels, name, None)


def encode_diff(a: torch.Tensor, b: torch.Tensor, codec: str) -> list[memoryview] | None:
    """``encode(a - b, codec)``, the same frames, in one pass without a − b as a vector (int8/int4
    with the C kernels); None where the kernels do not serve it (then the caller subtracts and
    encodes). ``NonFiniteError`` if a − b holds NaN/inf."""
    _check_codec(codec)
    kernel = _learner_kernel("encode_diff", codec)
    if kernel is None:
        return None
    return _encode_pair(kernel, a, b, codec)


def decode_add(frames: Sequence[Any], codec: str, numel: int, base: torch.Tensor,
               out: torch.Tensor | None = None) -> torch.Tensor | None:
    """``base + decode(frames, codec, numel)`` in fp32, the same values, in one pass without the
    decoded vector (int8/int4 with the C kernels), written into ``out`` (None: a new tensor);
    None where the kernels do not serve it. Raises as ``decode`` does (nothing written then)."""
    _check_codec(codec)
    _check_numel(numel)
    kernel = _learner_kernel("decode_add", codec)
    if kernel is None:
        return None
    _check_input(base)
    out = hostmem.empty_like(base) if out is None else out
    _check_input(out)
    if base.numel() != numel or out.numel() != numel:
        raise CodecError(f"base and out must hold {numel} values, got {base.numel()} and {out.numel()}")
    views = [_as_bytes_view(f) for f in frames]
    expected = _frame_nbytes(numel, codec)
    if len(views) != len(expected) or any(v.nbytes != nb for v, nb in zip(views, expected)):
        raise CodecError(f"codec {codec} frames for {numel} values must be {list(expected)} bytes, "
                         f"got {[v.nbytes for v in views]}")
    if not kernel(views[0], views[1], _LEVELS[codec], base.detach().numpy(), out.numpy()):
        raise NonFiniteError("non-finite values")
    return out


STREAM_MIN_BYTES = 1 << 20
"""Copies this large are written past the caches by the C kernel (``copy_into``)."""


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """dst ← src, the same values, with the C kernel's streaming stores (a learner's snapshot: a
    fresh buffer read again later, whose old lines need not be read nor other data evicted); False
    where it does not serve (the caller copies): not float32 contiguous CPU vectors of one length,
    under ``STREAM_MIN_BYTES``, or no kernels."""
    kernel = getattr(_kernels, "copy", None) if _kernels is not None else None
    if kernel is None or not all(t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()
                                 for t in (dst, src)):
        return False
    if dst.numel() != src.numel() or 4 * dst.numel() < STREAM_MIN_BYTES:
        return False
    split_run(kernel, dst.detach().numpy(), src.detach().numpy())   # over the boundary's threads
    return True
