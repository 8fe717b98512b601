"""The wire protocol: the one module that encodes and decodes every message.

Frame layout of every message, on PUB/SUB and on the fragment request path alike::

    [topic, header, payload_0, payload_1, ...]

- ``topic``: ``<run>|<kind>.<pppp>`` (ASCII, fixed-width fragment number), so a SUB prefix
  matches exactly one fragment of one run.
- ``header``: a msgpack map with the protocol version, run id, sender, kind, fragment,
  round/version/base, counters, codec, element count, payload frame sizes and a CRC32.
- ``payload_i``: raw bytes (codec frames, see ``common.quant``), sent without copying.

``decode`` is the exact inverse of ``encode``; anything malformed raises a ``WireError``
subclass, which daemons count and drop.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import msgpack

try:   # zlib-ng's CRC32 (SIMD folding): the same checksum as zlib's, ~15x faster (pyproject.toml)
    from zlib_ng.zlib_ng import crc32
except ImportError:   # pragma: no cover - the dependency is declared; a bare environment still works
    from zlib import crc32

if TYPE_CHECKING:
    import torch

_QUANT: Any = None


def _quant() -> Any:
    """``common.quant`` (and so torch, ~3 s of CPU on a loaded machine), imported on the first
    payload encoded or decoded: the broker reads message kinds and topics only, without torch."""
    global _QUANT
    if _QUANT is None:
        from common import quant
        _QUANT = quant
    return _QUANT

PROTOCOL_VERSION = 1

OPEN = "open"    # syncer -> learners: round r of fragment p is open (carries the current version)
UPDATE = "upd"   # learner -> syncer: quantized delta for an open round
FRAG = "frag"    # syncer -> learners: merged fragment: full value (base -1: broadcast after a recovery, or
                 # the reply to GET), or the quantized update Θ_v − Θ_base from version ``base`` (broadcast)
GET = "get"      # learner/monitor -> syncer (request path): send me fragment p
NEED = "need"    # syncer -> learners: a (re)started shard asks for the freshest copy of fragment p
HAVE = "have"    # learner -> syncer: its base value of fragment p (version, epoch), fp32
KINDS = (OPEN, UPDATE, FRAG, GET, NEED, HAVE)

_HEADER_KEYS = ("v", "run", "from", "kind", "frag", "epoch", "round", "attempt", "ver", "base",
                "steps", "tokens", "codec", "numel", "sizes", "crc", "t")


class WireError(ValueError):
    """A message that cannot be decoded; the receiver counts it and drops it."""


class FrameError(WireError):
    """Wrong number or shape of frames."""


class HeaderError(WireError):
    """The header is not a valid msgpack map with the expected fields and types."""


class ProtocolVersionError(WireError):
    """The sender speaks another protocol version."""


class PayloadError(WireError):
    """Payload sizes or checksum do not match the header, or the codec rejects it."""


class NonFinitePayload(PayloadError):
    """A well-formed payload whose values decode to NaN/inf (or would: int8/int4 scales beyond the
    fp32 range); ``Message.values`` never returns a non-finite value."""


class WrongRunError(WireError):
    """A well-formed message for another run."""


@dataclass(frozen=True, kw_only=True)
class Message:
    """One decoded message; ``payload`` holds the raw codec frames (not yet dequantized)."""

    kind: str
    run: str
    sender: str
    fragment: int
    epoch: int = 0
    round: int = -1
    attempt: int = 0
    version: int = -1
    base: int = -1
    steps: int = 0
    tokens: int = 0
    codec: str = ""
    numel: int = 0
    sent_at: float = 0.0
    payload: tuple[Any, ...] = field(default=(), repr=False)
    offset: int = 0
    """Of a chunk (a large fragment's reply in pieces): where its ``numel`` values start in the value."""
    of: int = 0
    """Of a chunk: the element count of the whole value (``numel`` for a message that is not a chunk)."""
    final: bool = False
    """Of an answer: its sender has taken its last step (it is flushing): shards then open rounds
    without the schedule's spacing, so its last steps are merged without it idling for a period."""
    decoded: torch.Tensor | None = field(default=None, repr=False, compare=False)
    """The values, already decoded and checked (a value assembled from its chunks, each of which
    was): ``values()`` returns this tensor instead of decoding the payload again."""

    @property
    def is_chunk(self) -> bool:
        return self.offset > 0 or self.of > self.numel

    @property
    def payload_nbytes(self) -> int:
        return sum(len(memoryview(f)) for f in self.payload)

    def values(self) -> torch.Tensor:
        """Dequantize the payload to a flat fp32 tensor, every value finite (raises PayloadError,
        ``NonFinitePayload`` for NaN/inf); ``decoded`` when that is set (the same tensor, not a copy)."""
        return self._checked("decode")

    def values_added_to(self, base: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``base + values()`` in fp32 (a learner's base plus a broadcast update: the value the shard
        computed, bit-identical), written into ``out`` (None: a new tensor); in one pass over the
        payload where the C kernels decode it, without the decoded values as a vector. Raises as
        ``values()`` does."""
        if self.decoded is None:
            fused = self._checked("decode_add", base, out)
            if fused is not None:
                return fused
        import torch   # loaded with common.quant already
        return torch.add(base, self.values(), out=out)

    def values_for_merge(self) -> Any:
        """The values as the shard's merge reads them: int8/int4 kept encoded and checked
        (``common.quant.EncodedVector``, decoded tile by tile in the merge) where the C kernels
        are built, else ``values()``. Raises as ``values()`` does."""
        return self._checked("encoded")

    def _checked(self, how: str, *args: Any) -> Any:
        """``decoded``, else ``common.quant``'s ``how`` (decode, encoded, decode_add) of the payload
        (``args`` after it), its errors as this module's."""
        if self.decoded is not None:
            return self.decoded
        quant = _quant()
        try:
            return getattr(quant, how)(self.payload, self.codec, self.numel, *args)
        except quant.NonFiniteError as e:
            raise NonFinitePayload(str(e)) from None
        except quant.CodecError as e:
            raise PayloadError(str(e)) from None


def topic(run: str, kind: str, fragment: int) -> bytes:
    """Exact topic of a message; also a SUB prefix matching exactly one fragment."""
    return f"{run}|{kind}.{fragment:04d}".encode()


def topic_prefix(run: str, kind: str) -> bytes:
    """SUB prefix matching every fragment of one kind in one run."""
    return f"{run}|{kind}.".encode()


def topic_kind(topic: bytes) -> str:
    """The kind a topic ``<run>|<kind>.<pppp>`` names, read without decoding the message (the
    broker's rules and counters): the text between the first ``|`` and the next ``.``, any bytes
    decoded with replacement ("" when there is none)."""
    return topic.partition(b"|")[2].partition(b".")[0].decode(errors="replace")


def topic_fragment(topic: bytes) -> int | None:
    """The fragment number a topic ``<run>|<kind>.<pppp>`` names: the digits after its last ``.``
    (None when there are none, or more than 9)."""
    digits = topic.rpartition(b".")[2]
    return int(digits) if 0 < len(digits) <= 9 and digits.isdigit() else None


def _crc(frames: Sequence[Any]) -> int:
    c = 0
    for f in frames:
        c = crc32(f, c)
    return c


def encode(*, kind: str, run: str, sender: str, fragment: int, values: torch.Tensor | None = None,
           codec: str = "fp32", epoch: int = 0, round: int = -1, attempt: int = 0, version: int = -1,
           base: int = -1, steps: int = 0, tokens: int = 0, encoded: tuple[Sequence[Any], int] | None = None,
           offset: int = 0, of: int = -1, final: bool = False) -> list[Any]:
    """Build the frames of one message; ``values`` (flat fp32) is quantized with ``codec``, or
    ``encoded`` = (frames already quantized with ``codec``, element count) is sent as it is.
    ``offset`` / ``of`` (>= 0): the message is a chunk, values [offset, offset + numel) of a
    value of ``of`` elements (the receiver assembles them: ``common.rpc.FragmentClient``).
    ``final``: an answer sent after the sender's last step (optional header key ``fin``).

    ``epoch`` identifies one life of the shard that owns the fragment (a run-wide counter
    incremented at every shard start). Versions never go back across epochs: a restarted shard
    continues from the freshest copy (its checkpoint, or a live learner's via NEED/HAVE).
    """
    if kind not in KINDS:
        raise ValueError(f"unknown message kind {kind!r}")
    payload: list[Any] = []
    numel = 0
    if encoded is not None:
        payload, numel = list(encoded[0]), int(encoded[1])
    elif values is not None:
        numel = int(values.numel())
        payload = list(_quant().encode(values, codec))
    else:
        codec = ""
    sizes = [len(memoryview(f)) for f in payload]
    header = {
        "v": PROTOCOL_VERSION, "run": run, "from": sender, "kind": kind, "frag": int(fragment),
        "epoch": int(epoch), "round": int(round), "attempt": int(attempt), "ver": int(version), "base": int(base),
        "steps": int(steps), "tokens": int(tokens), "codec": codec, "numel": numel,
        "sizes": sizes, "crc": _crc(payload), "t": time.time(),
    }
    if of >= 0:
        header["off"], header["of"] = int(offset), int(of)
    if final:
        header["fin"] = True
    return [topic(run, kind, fragment), msgpack.packb(header, use_bin_type=True), *payload]


def peek_sender(header: bytes) -> Any:
    """The ``from`` field of a header frame, read without checking the rest (the broker's sender
    rule, on every published message): None when the header is a map without it or not a map;
    HeaderError when it is not msgpack within small bounds (no header holds a longer string,
    array or map)."""
    try:
        head = msgpack.unpackb(header, raw=False, max_str_len=1024, max_bin_len=0, max_array_len=256,
                               max_map_len=64, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types
        raise HeaderError(f"header is not msgpack: {type(e).__name__}") from None
    return head.get("from") if isinstance(head, dict) else None


def _frame_bytes(f: Any) -> Any:
    """zmq.Frame -> its buffer; bytes/memoryview pass through."""
    buf = getattr(f, "buffer", None)
    return buf if buf is not None else f


def decode(frames: Sequence[Any], *, expect_run: str | None = None) -> Message:
    """Inverse of ``encode``. Raises a ``WireError`` subclass for anything malformed."""
    if len(frames) < 2:
        raise FrameError(f"expected >= 2 frames (topic, header), got {len(frames)}")
    parts = [_frame_bytes(f) for f in frames]
    try:
        header = msgpack.unpackb(parts[1], raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types
        raise HeaderError(f"header is not msgpack: {type(e).__name__}") from None
    if not isinstance(header, dict):
        raise HeaderError("header is not a map")
    if header.get("v") != PROTOCOL_VERSION:
        raise ProtocolVersionError(f"protocol version {header.get('v')!r}, expected {PROTOCOL_VERSION}")
    missing = [k for k in _HEADER_KEYS if k not in header]
    if missing:
        raise HeaderError(f"header lacks {', '.join(missing)}")
    ints = ("frag", "epoch", "round", "attempt", "ver", "base", "steps", "tokens", "numel", "crc")
    if not all(type(header[k]) is int for k in ints):
        raise HeaderError("integer header field has another type")
    if type(header["t"]) not in (int, float) or not math.isfinite(header["t"]):
        raise HeaderError("send time is not a finite number")
    if not all(isinstance(header[k], str) for k in ("run", "from", "kind", "codec")):
        raise HeaderError("string header field has another type")
    kind = header["kind"]
    if kind not in KINDS:
        raise HeaderError(f"unknown kind {kind!r}")
    if expect_run is not None and header["run"] != expect_run:
        raise WrongRunError(f"message for run {header['run']!r}, this is run {expect_run!r}")
    if bytes(parts[0]) != topic(header["run"], kind, header["frag"]):
        raise HeaderError("topic does not match header")
    if header["frag"] < 0 or header["numel"] < 0 or header["steps"] < 0 or header["tokens"] < 0:
        raise HeaderError("negative fragment, element count or counter")
    final = header.get("fin", False)
    if type(final) is not bool or (final and kind != UPDATE):
        raise HeaderError("fin is not a boolean of an answer")
    offset, of = header.get("off", 0), header.get("of", header["numel"])
    if type(offset) is not int or type(of) is not int or offset < 0 or offset + header["numel"] > of:
        raise HeaderError("chunk offset and size do not fit the value")
    payload = tuple(parts[2:])
    sizes = header["sizes"]
    if not isinstance(sizes, list) or len(sizes) != len(payload):
        raise PayloadError(f"header announces {len(sizes) if isinstance(sizes, list) else '?'} payload frames, got {len(payload)}")
    if not all(type(n) is int for n in sizes) or [len(memoryview(p)) for p in payload] != sizes:
        raise PayloadError("payload frame sizes differ from header")
    if payload:
        quant = _quant()
        if header["codec"] not in quant.CODECS:
            raise PayloadError(f"unknown codec {header['codec']!r}")
        if quant.payload_nbytes(header["numel"], header["codec"]) != sum(sizes):
            raise PayloadError("payload size does not match codec and element count")
    if _crc(payload) != header["crc"]:
        raise PayloadError("payload checksum mismatch")
    return Message(kind=kind, run=header["run"], sender=header["from"], fragment=header["frag"],
                   epoch=header["epoch"], round=header["round"], attempt=header["attempt"], version=header["ver"],
                   base=header["base"], steps=header["steps"], tokens=header["tokens"],
                   codec=header["codec"], numel=header["numel"], sent_at=float(header["t"]),
                   payload=payload, offset=offset, of=of, final=final)


HEADER_SLACK_BYTES = 64 << 10
"""Room for a header (msgpack, well under 1 KiB) and a topic, above the largest payload frame."""


def max_frame_bytes(largest_numel: int) -> int:
    """ZMQ_MAXMSGSIZE of a socket receiving fragments: the largest legitimate frame of a run is a
    fragment's values at fp32 (4 bytes each: every codec's frames are smaller) plus slack."""
    return 4 * max(0, int(largest_numel)) + HEADER_SLACK_BYTES


def message_nbytes(frames: Sequence[Any]) -> int:
    """Total bytes of a frame list (for counters)."""
    return sum(len(memoryview(_frame_bytes(f))) for f in frames)


# ------------------------------------------------------------------ peer bootstrap (learner <-> learner)
# A joining learner's DEALER asks a training peer's ROUTER for its state (ALGORITHM §8). Every peer
# message is ``[verb, head, piece?]``; ``head`` is a msgpack map with the peer format's version ``v``:
#
#     ask    [b"state?", {v, from}]                      joiner -> peer
#     busy   [b"busy",   {v}]                            peer -> joiner: not now (load from the shards)
#     state  [b"state",  {v, skeleton, sizes, pieces}]   peer -> joiner: the state's msgpack skeleton
#     chunk  [b"chunk",  {v, i, off, crc}, piece]        peer -> joiner: bytes of tensor i at off, CRC32
#
# The format is private between learners of the same version: another version is refused
# (``PeerVersionError``) and counted like any malformed message.

PEER_VERSION = 1
PEER_ASK, PEER_BUSY, PEER_STATE, PEER_CHUNK = b"state?", b"busy", b"state", b"chunk"
_PEER_HEAD_KEYS = {PEER_ASK: ("from",), PEER_BUSY: (), PEER_STATE: ("skeleton", "sizes", "pieces"),
                   PEER_CHUNK: ("i", "off", "crc")}


class PeerVersionError(HeaderError):
    """A peer message of another peer format version."""


@dataclass(frozen=True)
class PeerMessage:
    """A decoded peer message: its verb, its head (without ``v``) and, for a chunk, the piece."""

    verb: bytes
    head: dict[str, Any]
    piece: Any = None


def _peer(verb: bytes, head: dict[str, Any], *piece: Any) -> list[Any]:
    return [verb, msgpack.packb({"v": PEER_VERSION, **head}, use_bin_type=True), *piece]


def encode_peer_ask(requester: str) -> list[Any]:
    return _peer(PEER_ASK, {"from": requester[:200]})


def encode_peer_busy() -> list[Any]:
    return _peer(PEER_BUSY, {})


def encode_peer_state(skeleton: Any, sizes: Sequence[int], pieces: int) -> list[Any]:
    return _peer(PEER_STATE, {"skeleton": skeleton, "sizes": list(sizes), "pieces": pieces})


def encode_peer_chunk(index: int, offset: int, piece: Any) -> list[Any]:
    """A piece of tensor ``index`` at byte ``offset``; ``piece`` (a buffer) is sent as its own frame."""
    return _peer(PEER_CHUNK, {"i": index, "off": offset, "crc": crc32(piece)}, piece)


def decode_peer(frames: Sequence[Any]) -> PeerMessage:
    """The exact inverse of the ``encode_peer_*`` functions; ``WireError`` on anything else (a
    ``PeerVersionError`` for another format version, a ``PayloadError`` for a damaged chunk)."""
    frames = [f if isinstance(f, bytes) else bytes(memoryview(_frame_bytes(f))) for f in frames]
    if not frames or frames[0] not in _PEER_HEAD_KEYS:
        raise FrameError(f"not a peer verb: {frames[0][:16]!r}" if frames else "no frames")
    verb = frames[0]
    if len(frames) != (3 if verb == PEER_CHUNK else 2):
        raise FrameError(f"peer {verb.decode()}: {len(frames)} frames")
    try:
        head = msgpack.unpackb(frames[1], raw=False, strict_map_key=False)
    except Exception as e:   # msgpack raises several types for garbage
        raise HeaderError(f"peer head is not msgpack: {e!r}"[:200]) from None
    if not isinstance(head, dict) or "v" not in head:
        raise HeaderError("peer head is not a map with a version")
    if head["v"] != PEER_VERSION:
        raise PeerVersionError(f"peer format version {head['v']!r}, this learner speaks {PEER_VERSION}")
    missing = [k for k in _PEER_HEAD_KEYS[verb] if k not in head]
    if missing:
        raise HeaderError(f"peer {verb.decode()}: missing {missing}")
    head.pop("v")
    piece = frames[2] if verb == PEER_CHUNK else None
    if piece is not None and crc32(piece) != head["crc"]:
        raise PayloadError("peer chunk checksum mismatch")
    return PeerMessage(verb, head, piece)
