"""TokenCorpus: seeded disjoint streams, batch i in O(1), fixed held-out windows, flat memory, and
one-line errors on malformed corpora."""
from __future__ import annotations

import json
import os
import time
import tracemalloc

import numpy as np
import pytest

from common.task_args import TaskError
from ddloco.data import TokenCorpus
from ddloco.data.permutation import Permutation
from ddloco.data.windows import stream_share

pytestmark = pytest.mark.timeout(30)


def write_corpus(root, train: list[np.ndarray], heldout: list[np.ndarray], dtype: str = "uint32") -> str:
    """A corpus directory in the prepared format, made directly from token arrays."""
    os.makedirs(root, exist_ok=True)
    index = {"format": "ddloco-tokens", "version": 1, "dtype": dtype, "eos_id": 0,
             "tokenizer": {"hash": "0" * 16, "source": "test", "vocab_size": 1 << 20},
             "train": [], "heldout": [], "inputs": [], "heldout_fraction": 0.1, "seed": 0}
    for split, arrays in (("train", train), ("heldout", heldout)):
        for k, arr in enumerate(arrays):
            name = f"{split}-{k:05d}.bin"
            np.asarray(arr, dtype=dtype).tofile(os.path.join(root, name))
            index[split].append({"file": name, "tokens": len(arr)})
    with open(os.path.join(root, "index.json"), "w") as f:
        json.dump(index, f)
    return str(root)


def shards(lengths: list[int]) -> list[np.ndarray]:
    """Shard k holds k*1e6 + 0, 1, 2, ...: a window's tokens say which shard and offset it came from,
    and a window spanning two shards would show a jump."""
    return [k * 1_000_000 + np.arange(n, dtype=np.int64) for k, n in enumerate(lengths)]


SEQ = 4  # windows of 5 tokens


@pytest.fixture
def corpus(tmp_path) -> TokenCorpus:
    # 23 + 41 + 18 windows (each shard has a ragged tail that no window may use)
    root = write_corpus(tmp_path / "c", shards([23 * 5 + 3, 41 * 5 + 4, 18 * 5 + 1]), shards([7 * 5 + 2]))
    return TokenCorpus.open(root, streams=4)


def all_train_windows() -> set[int]:
    return {k * 1_000_000 + 5 * w for k, n in enumerate([23, 41, 18]) for w in range(n)}


def test_windows_never_span_shards_and_cover_the_train_split_once_per_epoch(corpus):
    assert corpus.train_windows(SEQ) == 82
    seen: list[int] = []
    for stream in range(4):
        _, _, per_epoch = stream_share(82, 4, stream)
        for i in range(per_epoch):  # batch_size 1: one read per batch
            (row,) = corpus.train_batch(stream, seed=7, index=i, batch_size=1, seq_len=SEQ)
            assert row.dtype == np.int64 and np.all(np.diff(row) == 1), f"window spans shards: {row}"
            seen.append(int(row[0]))
    assert len(seen) == len(set(seen)) == 82
    assert set(seen) == all_train_windows()


def test_streams_are_disjoint_within_an_epoch_and_epochs_reshuffle(corpus):
    def reads(stream: int, n: int, batch: int = 3) -> list[int]:
        rows = np.concatenate([corpus.train_batch(stream, 7, i, batch, SEQ) for i in range(-(-n // batch))])
        return [int(r[0]) for r in rows[:n]]
    per = [stream_share(82, 4, s)[2] for s in range(4)]
    epoch0 = [set(reads(s, per[s])) for s in range(4)]
    for a in range(4):
        for b in range(a + 1, 4):
            assert not epoch0[a] & epoch0[b], f"streams {a} and {b} share windows"
    epoch1 = [reads(s, 2 * per[s])[per[s]:] for s in range(4)]  # a new permutation, dealt again
    assert sorted(w for part in epoch1 for w in part) == sorted(all_train_windows())
    assert set(epoch1[1]) != epoch0[1], "epoch 1 must be a new permutation"
    assert reads(1, 10) != [int(r[0]) for r in np.concatenate(
        [corpus.train_batch(1, 8, i, 5, SEQ) for i in range(2)])], "the seed must change the order"


def test_batch_i_equals_the_ith_batch_of_the_iteration_from_zero(corpus):
    def reference(stream: int, seed: int, n_reads: int) -> list[int]:
        """Build each epoch's whole permutation explicitly and deal it by hand."""
        q, s_eff, per_epoch = stream_share(82, 4, stream)
        out: list[int] = []
        starts = np.cumsum([0, 23, 41, 18])
        for epoch in range(n_reads // per_epoch + 1):
            order = Permutation(82, (seed, epoch))(np.arange(82))
            for w in order[q::s_eff]:
                k = int(np.searchsorted(starts, w, side="right")) - 1
                out.append(k * 1_000_000 + 5 * int(w - starts[k]))
        return out[:n_reads]
    B = 6
    for stream in (0, 3, 5):  # stream 5 deals like stream 1 (5 mod 4)
        ref = reference(stream, 3, 12 * B)
        iterated = [int(r[0]) for i in range(12) for r in corpus.train_batch(stream, 3, i, B, SEQ)]
        assert iterated == ref
        for i in (11, 4, 0, 7):  # any order: each batch stands alone
            assert [int(r[0]) for r in corpus.train_batch(stream, 3, i, B, SEQ)] == ref[i * B:(i + 1) * B]


def test_a_far_batch_costs_the_same_as_the_first(corpus):
    corpus.train_batch(2, 0, 0, 8, SEQ)
    t0 = time.perf_counter()
    far = corpus.train_batch(2, 0, 10 ** 12, 8, SEQ)
    assert time.perf_counter() - t0 < 0.5
    assert far.shape == (8, SEQ + 1) and all(int(r[0]) in all_train_windows() for r in far)


def test_heldout_windows_are_fixed_in_order_and_apart_from_train(corpus, tmp_path):
    batches = corpus.heldout_batches(batch_size=3, seq_len=SEQ, max_batches=10)
    assert [len(b) for b in batches] == [3, 3, 1]  # 7 windows; the 2-token tail is unused
    firsts = [int(r[0]) for b in batches for r in b]
    assert firsts == [5 * w for w in range(7)]
    assert [len(b) for b in corpus.heldout_batches(3, SEQ, max_batches=2)] == [3, 3]
    again = TokenCorpus.open(corpus.path, streams=2).heldout_batches(3, SEQ, 10)
    assert all(np.array_equal(a, b) for a, b in zip(batches, again))


def test_more_streams_than_windows_deal_to_every_window(tmp_path):
    c = TokenCorpus.open(write_corpus(tmp_path / "s", shards([3 * 5]), []), streams=16)
    firsts = {int(c.train_batch(s, 0, 0, 1, SEQ)[0, 0]) for s in range(3)}
    assert firsts == {0, 5, 10}


def test_opening_and_reading_millions_of_windows_allocates_no_array_of_windows(tmp_path):
    root = tmp_path / "big"
    root.mkdir()
    tokens = 40_000_000  # a sparse file: 20 M windows of 2 tokens, an index array would be 160 MB
    with open(root / "train-00000.bin", "wb") as f:
        f.truncate(tokens * 2)
    (root / "index.json").write_text(json.dumps({
        "format": "ddloco-tokens", "version": 1, "dtype": "uint16", "eos_id": 0,
        "tokenizer": {"hash": "0" * 16, "source": "t", "vocab_size": 100},
        "train": [{"file": "train-00000.bin", "tokens": tokens}], "heldout": [], "inputs": [],
        "heldout_fraction": 0.0, "seed": 0}))
    tracemalloc.start()
    try:
        c = TokenCorpus.open(str(root))
        assert c.train_windows(1) == tokens // 2
        for i in (0, 1, 123_456):
            assert c.train_batch(5, 1, i, 64, 1).shape == (64, 2)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000, f"peak {peak} bytes: something of the corpus's size was built"


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def test_reading_random_windows_of_a_large_shard_keeps_rss_flat(tmp_path):
    tokens = 24 * 2 ** 20   # 48 MB of real (not sparse) data, in the page cache once written
    data = np.random.default_rng(0).integers(0, 60_000, tokens, dtype=np.uint16)
    c = TokenCorpus.open(write_corpus(tmp_path / "big", [data], [data[:1000]], dtype="uint16"))
    del data
    c.train_batch(0, 0, 0, 16, 255)
    before = _rss_mb()
    for i in range(300):   # 4,800 windows spread over the whole shard
        batch = c.train_batch(1, 0, i, 16, 255)
    assert batch.shape == (16, 256)
    assert _rss_mb() - before < 8, f"RSS grew by {_rss_mb() - before:.0f} MB reading 4,800 windows"
    c.close()


@pytest.mark.parametrize("n", [1, 2, 3, 5, 17, 64, 1000, 4097])
def test_the_permutation_is_a_bijection_chosen_by_its_key(n):
    image = Permutation(n, (1, 0))(np.arange(n))
    assert sorted(image.tolist()) == list(range(n))
    if n >= 17:
        assert not np.array_equal(image, Permutation(n, (1, 1))(np.arange(n)))
        assert not np.array_equal(image, np.arange(n))


def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_malformed_corpora_are_one_line_errors(tmp_path):
    with pytest.raises(TaskError) as e:
        TokenCorpus.open(str(tmp_path / "nope"))
    assert "no such corpus directory" in _one_line(e)
    (tmp_path / "empty").mkdir()
    with pytest.raises(TaskError) as e:
        TokenCorpus.open(str(tmp_path / "empty"))
    assert "no index.json" in _one_line(e)
    root = write_corpus(tmp_path / "c", shards([50]), [])
    index_path = os.path.join(root, "index.json")
    good = open(index_path).read()
    for text, words in [("{not json", "not valid JSON"),
                        (good.replace('"version": 1', '"version": 9'), "version 9"),
                        (good.replace('"uint32"', '"float32"'), "dtype 'float32'"),
                        (good.replace('"train-00000.bin"', '"../x.bin"'), "malformed train shard")]:
        open(index_path, "w").write(text)
        with pytest.raises(TaskError) as e:
            TokenCorpus.open(root)
        assert words in _one_line(e)
    open(index_path, "w").write(good)
    with open(os.path.join(root, "train-00000.bin"), "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(TaskError) as e:
        TokenCorpus.open(root)
    assert "train-00000.bin has 202 bytes, the index says 50 tokens x 4" in _one_line(e)
    os.remove(os.path.join(root, "train-00000.bin"))
    with pytest.raises(TaskError) as e:
        TokenCorpus.open(root)
    assert "train-00000.bin is missing" in _one_line(e)


def test_a_corpus_shorter_than_one_batch_is_refused(tmp_path):
    c = TokenCorpus.open(write_corpus(tmp_path / "c", shards([5 * 5 + 4]), []))
    with pytest.raises(TaskError) as e:
        c.train_batch(0, 0, 0, batch_size=6, seq_len=SEQ)
    assert "shorter than one batch" in _one_line(e) and "5 window(s)" in str(e.value)
    assert c.train_batch(0, 0, 0, batch_size=5, seq_len=SEQ).shape == (5, 5)


def test_the_progress_bar_draws_on_a_terminal_only():
    import io
    from ddloco.data.prepare import ProgressBar

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True
    term, pipe = Terminal(), io.StringIO()
    for stream in (term, pipe):
        bar = ProgressBar(stream, files=2, enabled=stream.isatty())
        bar.add(chars=2_000_000, tokens=500_000)
        bar.add(files=1)
        bar.close()
    assert "files 1/2  tokens 0.50M" in term.getvalue() and "MB/s" in term.getvalue()
    assert pipe.getvalue() == ""
