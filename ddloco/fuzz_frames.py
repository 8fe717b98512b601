"""The inputs of `ddloco fuzz`: well-formed messages of a run (``templates``), mutated the way a
broken or hostile peer would (``mutate``: bytes flipped, frames cut, added, dropped or swapped,
header fields given ``WEIRD`` values, checksums fixed up so the payload decoders are reached), and
purely random frames (``random_frames``). Pure functions of a seeded ``random.Random``.
"""
from __future__ import annotations

import random
import struct
import zlib
from typing import Any, Sequence

import msgpack
import torch

from common import wire

WEIRD = [0, -1, 1, 2**31, 2**63 - 1, 2**64 - 1, -(2**63), 10**30, float("nan"), float("inf"), -float("inf"),
         1e308, "", "x" * 300, "\x00", b"\xff" * 8, [], [1, 2, 3], {}, {"a": 1}, None, True, 1.5]


def templates(run: str, sender: str, numels: Sequence[int], rng: random.Random) -> list[tuple[str, list[bytes]]]:
    """(target, frames) of well-formed messages: what each endpoint is meant to receive."""
    out: list[tuple[str, list[bytes]]] = []
    for p, n in enumerate(numels):
        v = torch.randn(n) * 0.01
        for codec in ("int4", "fp32", "bf16", "int8"):
            out.append(("broker", _bytes(wire.encode(kind=wire.UPDATE, run=run, sender=sender, fragment=p, values=v,
                                                     codec=codec, epoch=1, round=rng.randrange(8), base=1, steps=4,
                                                     tokens=256))))
        out.append(("broker", _bytes(wire.encode(kind=wire.HAVE, run=run, sender=sender, fragment=p, values=v,
                                                 codec="fp32", epoch=1, version=1))))
        out.append(("broker", _bytes(wire.encode(kind=wire.FRAG, run=run, sender=sender, fragment=p, values=v,
                                                 codec="fp32", epoch=1, version=10**6))))
        out.append(("broker", _bytes(wire.encode(kind=wire.OPEN, run=run, sender=sender, fragment=p, epoch=1,
                                                 round=0, version=1))))
        out.append(("shard", _bytes(wire.encode(kind=wire.GET, run=run, sender=sender, fragment=p))))
    out.append(("peer", wire.encode_peer_ask(sender)))
    out.append(("peer", [b"state?"]))
    return out


def _bytes(frames: list[Any]) -> list[bytes]:
    return [bytes(memoryview(f)) if not isinstance(f, bytes) else f for f in frames]


def _fix_crc(frames: list[bytes]) -> list[bytes]:
    """Recompute a wire header's CRC over the (mutated) payload, so the decoders behind it run."""
    try:
        head = msgpack.unpackb(frames[1], raw=False, strict_map_key=False)
        if isinstance(head, dict) and "crc" in head:
            crc = 0
            for f in frames[2:]:
                crc = zlib.crc32(f, crc)
            head["crc"] = crc
            head["sizes"] = [len(f) for f in frames[2:]]
            return [frames[0], msgpack.packb(head, use_bin_type=True), *frames[2:]]
    except Exception:
        pass
    return frames


def mutate(frames: list[bytes], rng: random.Random) -> list[bytes]:
    """One to three wire-aware mutations of a message."""
    fr = [bytearray(f) for f in frames]
    for _ in range(rng.randint(1, 3)):
        op = rng.randrange(10)
        i = rng.randrange(len(fr)) if fr else 0
        if op == 0 and fr and fr[i]:                       # flip bytes
            for _ in range(rng.randint(1, 8)):
                j = rng.randrange(len(fr[i]))
                fr[i][j] = rng.randrange(256)
        elif op == 1 and fr:                               # cut a frame
            fr[i] = fr[i][:rng.randrange(len(fr[i]) + 1)]
        elif op == 2 and fr:                               # extend a frame
            fr[i] += bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))
        elif op == 3 and len(fr) > 1:                      # drop a frame
            del fr[i]
        elif op == 4:                                      # add a frame
            fr.insert(rng.randrange(len(fr) + 1), bytearray(rng.randbytes(rng.randint(0, 128))))
        elif op in (5, 6) and len(fr) > 1:                 # a header field gets a weird value
            try:
                head = msgpack.unpackb(bytes(fr[1]), raw=False, strict_map_key=False)
                if isinstance(head, dict) and head:
                    key = rng.choice(list(head))
                    if rng.random() < 0.15:
                        del head[key]
                    else:
                        head[key] = rng.choice(WEIRD)
                    fr[1] = bytearray(msgpack.packb(head, use_bin_type=True))
            except Exception:
                fr[1] = bytearray(rng.randbytes(rng.randint(0, 64)))
        elif op == 7 and fr:                               # topic: another kind, fragment or run
            t = bytes(fr[0]).split(b"|", 1)
            kind = rng.choice([b"upd", b"have", b"frag", b"open", b"need", b"get", b"zzz", b""])
            frag = rng.choice([b"0000", b"9999", b"-001", b"abcd", b""])
            fr[0] = bytearray((t[0] if rng.random() < 0.8 else rng.randbytes(4)) + b"|" + kind + b"." + frag)
        elif op == 8 and len(fr) > 2:                      # swap payload frames
            j = rng.randrange(2, len(fr))
            fr[i], fr[j] = fr[j], fr[i]
        else:                                              # int4/bf16 scales at the extremes
            if len(fr) > 3 and len(fr[3]) >= 2:
                fr[3][0:2] = struct.pack("<H", rng.choice([0x7F7F, 0xFF7F, 0x7F80, 0xFFFF, 0x0001]))
    out = [bytes(f) for f in fr]
    return _fix_crc(out) if rng.random() < 0.5 else out


def random_frames(rng: random.Random) -> list[bytes]:
    return [rng.randbytes(rng.choice([0, 1, 4, 16, 64, 300])) for _ in range(rng.randint(1, 6))]
