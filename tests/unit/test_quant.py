"""Wire codecs: round trips within their error bounds, exact frame sizes, strict decoding; the C
kernels and the torch implementation byte for byte the same.

Every test runs twice, once per implementation of the int8/int4 codecs (``impl``)."""
from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import sysconfig

import numpy as np
import pytest
import torch

from common import quant
from common.quant import BLOCK, CODECS, CodecError, decode, encode, payload_nbytes

_BUILT = quant._kernels


@pytest.fixture(autouse=True, params=["c", "torch"])
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test with the C kernels, then with the torch implementation."""
    if request.param == "c":
        if _BUILT is None:
            pytest.skip("common._qkernels is not built here (no C compiler at install)")
        monkeypatch.setattr(quant, "_kernels", _BUILT)
    else:
        monkeypatch.setattr(quant, "_kernels", None)
    return request.param

SIZES = [0, 1, 2, 3, 63, 64, 65, 127, 128, 129, 1000, 4097]
BF16_SCALE_SLACK = 1 + 2**-7   # the block scale is rounded to bf16 before quantising


def _vector(n: int, seed: int = 0) -> torch.Tensor:
    """Random vector whose blocks have very different magnitudes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    magnitudes = 10.0 ** torch.randint(-4, 4, (math.ceil(n / BLOCK),), generator=g).float()
    return x * magnitudes.repeat_interleave(BLOCK)[:n]


def _round_trip(x: torch.Tensor, codec: str) -> torch.Tensor:
    frames = encode(x, codec)
    return decode([bytes(f) for f in frames], codec, x.numel())


def _block_absmax(x: torch.Tensor) -> torch.Tensor:
    """Per-element absmax of the element's block, [n]."""
    n = x.numel()
    padded = torch.zeros(math.ceil(n / BLOCK) * BLOCK)
    padded[:n] = x.abs()
    return padded.view(-1, BLOCK).amax(dim=1).repeat_interleave(BLOCK)[:n]


@pytest.mark.parametrize("n", SIZES)
def test_fp32_round_trip_is_exact(n: int) -> None:
    x = _vector(n)
    y = _round_trip(x, "fp32")
    assert y.dtype == torch.float32 and y.shape == (n,)
    assert torch.equal(x, y)


@pytest.mark.parametrize("n", SIZES)
def test_bf16_relative_error_is_at_most_2_pow_minus_8(n: int) -> None:
    x = _vector(n)
    y = _round_trip(x, "bf16")
    assert y.shape == (n,)
    rel = (y - x).abs() / x.abs().clamp_min(1e-30)
    assert bool((rel <= 2**-8).all()), f"max relative error {rel.max().item()} > 2^-8"


def test_bf16_rounds_to_nearest() -> None:
    # 1 + 3*2^-9 lies between bf16 neighbours 1 + 2^-7 and 1 + 2*2^-7; nearest is 1 + 2^-7.
    x = torch.tensor([1 + 3 * 2**-9, 1 + 2**-9 * 1.5], dtype=torch.float32)
    y = _round_trip(x, "bf16")
    assert y.tolist() == [1 + 2**-7, 1.0]


@pytest.mark.parametrize("codec,levels", [("int8", 127), ("int4", 7)])
@pytest.mark.parametrize("n", SIZES)
def test_blockwise_error_is_at_most_half_a_step_of_its_block(codec: str, levels: int, n: int) -> None:
    x = _vector(n, seed=n)
    y = _round_trip(x, codec)
    assert y.shape == (n,)
    bound = _block_absmax(x) / (2 * levels) * BF16_SCALE_SLACK * (1 + 1e-6)
    err = (y - x).abs()
    assert bool((err <= bound).all()), f"{codec}: worst error / bound = {(err / bound).max()}"


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_block_extremes_decode_close_to_the_absmax(codec: str) -> None:
    x = _vector(640, seed=3)
    y = _round_trip(x, codec)
    top = x.view(-1, BLOCK).abs().argmax(dim=1) + torch.arange(10) * BLOCK
    rel = ((y[top] - x[top]).abs() / x[top].abs())
    assert bool((rel <= 2**-8).all()), f"extreme of a block off by {rel.max()} relative"


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("n", [0, 1, 64, 100, 1001])
def test_zero_vector_round_trips_to_zeros(codec: str, n: int) -> None:
    y = _round_trip(torch.zeros(n), codec)
    assert torch.equal(y, torch.zeros(n))


def test_all_zero_block_next_to_a_nonzero_block_stays_zero() -> None:
    x = torch.zeros(3 * BLOCK)
    x[BLOCK:2 * BLOCK] = torch.linspace(-1, 1, BLOCK)
    for codec in ("int8", "int4"):
        y = _round_trip(x, codec)
        assert not bool(torch.isnan(y).any())
        assert torch.equal(y[:BLOCK], torch.zeros(BLOCK))
        assert torch.equal(y[2 * BLOCK:], torch.zeros(BLOCK))


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("n", SIZES)
def test_frames_have_exactly_the_announced_size(codec: str, n: int) -> None:
    frames = encode(_vector(n), codec)
    assert all(isinstance(f, memoryview) and f.format == "B" for f in frames)
    assert sum(f.nbytes for f in frames) == payload_nbytes(n, codec)


@pytest.mark.parametrize("n", SIZES)
def test_payload_sizes_follow_the_layout(n: int) -> None:
    blocks = math.ceil(n / 64)
    assert payload_nbytes(n, "fp32") == 4 * n
    assert payload_nbytes(n, "bf16") == 2 * n
    assert payload_nbytes(n, "int8") == n + 2 * blocks
    assert payload_nbytes(n, "int4") == math.ceil(n / 2) + 2 * blocks
    frames = encode(_vector(n), "int4")
    assert [f.nbytes for f in frames] == [math.ceil(n / 2), 2 * blocks]


def test_int4_packs_low_nibble_first() -> None:
    x = torch.zeros(BLOCK)
    x[0], x[1], x[2] = 7.0, -7.0, 1.0          # scale = 1: q = 7, -7, 1
    values, scales = encode(x, "int4")
    assert values[0] == (7 | (0x9 << 4))       # -7 is 0b1001 in 4-bit two's complement
    assert values[1] == 1
    assert torch.frombuffer(bytearray(scales), dtype=torch.bfloat16)[0].item() == 1.0


def test_encoded_frames_do_not_alias_the_input() -> None:
    x = _vector(100)
    expected = x.clone()
    frames = {codec: encode(x, codec) for codec in CODECS}
    x.fill_(123.0)
    assert torch.equal(decode(frames["fp32"], "fp32", 100), expected)


def test_decode_accepts_memoryviews_numpy_arrays_and_bytearrays() -> None:
    x = _vector(300)
    frames = encode(x, "int8")
    reference = decode(frames, "int8", 300)
    assert torch.equal(decode([np.frombuffer(f, dtype=np.uint8) for f in frames], "int8", 300),
                       reference)
    assert torch.equal(decode([bytearray(f) for f in frames], "int8", 300), reference)


def test_decode_accepts_zmq_frames() -> None:
    zmq = pytest.importorskip("zmq")
    x = _vector(300)
    frames = [zmq.Frame(bytes(f)) for f in encode(x, "int4")]
    assert torch.equal(decode(frames, "int4", 300), _round_trip(x, "int4"))


@pytest.mark.parametrize("codec", CODECS)
def test_frames_round_trip_through_zmq_sent_with_copy_false(codec: str) -> None:
    zmq = pytest.importorskip("zmq")
    ctx = zmq.Context()
    tx, rx = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        tx.bind(f"inproc://quant-{codec}")
        rx.connect(f"inproc://quant-{codec}")
        x = _vector(1001)
        tx.send_multipart(encode(x, codec), copy=False)
        received = rx.recv_multipart(copy=False)
        assert torch.equal(decode(received, codec, 1001), _round_trip(x, codec))
    finally:
        tx.close(linger=0)
        rx.close(linger=0)
        ctx.term()


@pytest.mark.parametrize("codec", CODECS)
def test_wrong_frame_length_raises(codec: str) -> None:
    frames = [bytes(f) for f in encode(_vector(200), codec)]
    for i in range(len(frames)):
        for bad in (frames[i][:-1], frames[i] + b"\0"):
            broken = list(frames)
            broken[i] = bad
            with pytest.raises(CodecError, match=f"frame {i}"):
                decode(broken, codec, 200)
    with pytest.raises(CodecError):
        decode(frames, codec, 201)


@pytest.mark.parametrize("codec", CODECS)
def test_wrong_frame_count_raises(codec: str) -> None:
    frames = [bytes(f) for f in encode(_vector(10), codec)]
    with pytest.raises(CodecError, match="frame"):
        decode(frames + [b""], codec, 10)
    with pytest.raises(CodecError, match="frame"):
        decode(frames[:-1], codec, 10)


def test_unknown_codec_raises() -> None:
    with pytest.raises(CodecError, match="unknown codec 'int2'"):
        encode(torch.zeros(4), "int2")
    with pytest.raises(CodecError, match="unknown codec"):
        decode([b""], "fp16", 0)
    with pytest.raises(CodecError, match="unknown codec"):
        payload_nbytes(4, "int3")


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_raises(codec: str, bad: float) -> None:
    x = _vector(130)
    x[77] = bad
    with pytest.raises(CodecError, match="non-finite values"):
        encode(x, codec)


def test_bf16_overflow_raises() -> None:
    with pytest.raises(CodecError, match="non-finite values"):
        encode(torch.tensor([3.4e38]), "bf16")


def test_non_finite_payload_raises() -> None:
    nan_fp32 = np.array([1.0, np.nan], dtype=np.float32).tobytes()
    with pytest.raises(CodecError, match="non-finite values"):
        decode([nan_fp32], "fp32", 2)
    inf_scale = np.array([0x7F80], dtype=np.int16).tobytes()   # bf16 +inf
    with pytest.raises(CodecError, match="non-finite values"):
        decode([b"\x01", inf_scale], "int8", 1)


@pytest.mark.parametrize(
    "x",
    [
        torch.zeros(8, dtype=torch.float64),
        torch.zeros(8, dtype=torch.bfloat16),
        torch.zeros(4, 4),
        torch.zeros(16)[::2],
    ],
    ids=["float64", "bfloat16", "2-d", "strided"],
)
def test_wrong_kind_of_tensor_raises(x: torch.Tensor) -> None:
    with pytest.raises(CodecError):
        encode(x, "fp32")


def test_large_vector_round_trips_within_bounds() -> None:
    x = torch.randn(1 << 20)
    for codec, levels in (("int8", 127), ("int4", 7)):
        y = decode(encode(x, codec), codec, x.numel())
        bound = _block_absmax(x) / (2 * levels) * BF16_SCALE_SLACK * (1 + 1e-6)
        assert bool(((y - x).abs() <= bound).all()), codec


# --------------------------------------------------------------------------------------------
# the two implementations agree


def _exact_ties(levels: int, g: torch.Generator, blocks: int = 12) -> torch.Tensor:
    """Blocks whose absmax is ``levels`` (so the scale is exactly 1, and times a power of two
    exactly that) and whose other values are k + 0.5: every division lands on a tie, which
    round-half-to-even must send to the even neighbour (half away from zero would not)."""
    k = torch.randint(-levels, levels, (blocks, BLOCK - 2), generator=g).float() + 0.5
    ends = torch.tensor([float(levels), -float(levels)]).expand(blocks, 2)
    return torch.cat([ends, k], dim=1).reshape(-1)


def _cases() -> list[torch.Tensor]:
    """Vectors that exercise every branch: partial blocks, zero blocks, ties, tiny and huge
    magnitudes (bf16 scales that are subnormal or round to 0), blocks of one repeated value."""
    g = torch.Generator().manual_seed(7)
    out = [_vector(n, seed) for seed in range(3) for n in SIZES]
    out.append(torch.randn(5000, generator=g) * 1e-39)                  # subnormal scales
    out.append(torch.randn(333, generator=g) * 1e-44)                   # scales that round to 0
    out.append(torch.randn(4096, generator=g) * 3e37)                   # near the fp32 limit
    out.append(torch.arange(-7, 7.5, 0.5).repeat(20) * 0.37)             # near .5 steps (bf16 scale)
    out.extend(_exact_ties(7, g) * m for m in (1.0, 4.0, 2.0 ** -10))     # x / scale exactly k + 0.5
    out.append(_exact_ties(127, g))
    half_zero = torch.randn(1000, generator=g)
    half_zero[:500] = 0
    out.append(half_zero)
    out.append(torch.full((130,), -2.5))
    return out


@pytest.mark.parametrize("codec", ["int8", "int4"])
def test_c_kernels_match_the_torch_implementation_byte_for_byte(codec: str, impl: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    if impl != "c":
        pytest.skip("compares the C kernels against torch")
    rng = np.random.default_rng(3)
    for x in _cases():
        c_frames = [bytes(f) for f in encode(x, codec)]
        c_values = decode(c_frames, codec, x.numel())
        with monkeypatch.context() as m:
            m.setattr(quant, "_kernels", None)
            t_frames = [bytes(f) for f in encode(x, codec)]
            t_values = decode(t_frames, codec, x.numel())
        assert c_frames == t_frames, (codec, x.numel())
        assert torch.equal(c_values.view(torch.int32), t_values.view(torch.int32)), (codec, x.numel())
    for n in (1, 63, 64, 65, 1001):              # arbitrary payloads decode alike too (q = -8 incl.)
        sizes = quant._frame_nbytes(n, codec)
        values = rng.integers(0, 256, sizes[0], dtype=np.uint8).tobytes()
        scales = torch.randn(sizes[1] // 2).to(torch.bfloat16).view(torch.int16).numpy().tobytes()
        c = decode([values, scales], codec, n)
        with monkeypatch.context() as m:
            m.setattr(quant, "_kernels", None)
            t = decode([values, scales], codec, n)
        assert torch.equal(c.view(torch.int32), t.view(torch.int32)), (codec, n)


def test_the_portable_quantiser_matches_torch_too(impl: str) -> None:
    """The C quantiser has two bodies: AVX-512F intrinsics where the CPU has them (what the test
    above checks on such a machine) and the portable loop (``DDLOCO_KERNELS_AVX512=0``, read at
    import): the byte-for-byte comparison again, in a process that uses the other one."""
    if impl != "c":
        pytest.skip("compares the C kernels against torch")
    ours = quant._kernels.QUANTISER
    other = "portable" if ours == "avx512f" else ("avx512f" if _cpu_has_avx512f() else "portable")
    env = {**os.environ, "DDLOCO_KERNELS_AVX512": "0" if ours == "avx512f" else "1"}
    which = subprocess.run([sys.executable, "-c", "from common import quant; print(quant._kernels.QUANTISER)"],
                           capture_output=True, text=True, env=env, timeout=60)
    assert which.stdout.strip() == other, which
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
                          "-k", "byte_for_byte or non_finite_input"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert res.returncode == 0 and "passed" in res.stdout and "failed" not in res.stdout, \
        res.stdout[-3000:] + res.stderr[-2000:]


def _cpu_has_avx512f() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return " avx512f" in f.read()
    except OSError:
        return False


def test_the_c_kernels_are_built_where_a_compiler_is(impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """setup.py builds the extension as optional, so a broken build would pass silently: where
    a C compiler exists (as on CI) it must have been built and be what the codecs use, unless
    ``DDLOCO_KERNELS=torch`` asks for the torch implementation."""
    if impl != "c" and _BUILT is not None:
        pytest.skip("checked once")
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler on this machine")
    if not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        pytest.skip("no Python headers on this machine (Debian: python3-dev)")
    monkeypatch.delenv("DDLOCO_KERNELS", raising=False)
    built = quant._load_kernels()
    assert built is not None, "common._qkernels was not built (or is stale) although a C compiler is here"
    if _BUILT is not None:                                  # this process did not ask for torch
        assert quant.KERNEL == "c"
    for choice, loaded in (("auto", built), ("c", built), ("torch", None)):
        monkeypatch.setenv("DDLOCO_KERNELS", choice)
        assert quant._load_kernels() is loaded
    monkeypatch.setenv("DDLOCO_KERNELS", "fast")
    with pytest.raises(ImportError, match="auto, c or torch"):
        quant._load_kernels()


def test_an_extension_built_from_other_sources_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkout updated without a rebuild keeps an old .so: its ABI number differs, so the torch
    code runs (or, with DDLOCO_KERNELS=c, the import says why)."""
    if _BUILT is None:
        pytest.skip("common._qkernels is not built here")
    monkeypatch.setattr(_BUILT, "ABI", quant.KERNELS_ABI - 1)
    monkeypatch.delenv("DDLOCO_KERNELS", raising=False)
    assert quant._load_kernels() is None
    monkeypatch.setenv("DDLOCO_KERNELS", "c")
    with pytest.raises(ImportError, match="ABI"):
        quant._load_kernels()
