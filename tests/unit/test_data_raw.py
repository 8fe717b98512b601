"""RawCorpus: raw files tokenized on the fly, with TokenCorpus's methods: the held-out split and
tokens of `ddloco data prepare`, disjoint streams, batch i found by reading on."""
from __future__ import annotations

import json

import numpy as np
import pytest

from common.task_args import TaskError
from ddloco.data import TokenCorpus, open_corpus
from ddloco.data.cli import main
from ddloco.data.raw import RawCorpus
from ddloco.data.tokenizer import load_tokenizer, train_bpe

pytestmark = pytest.mark.timeout(60)

SEQ = 7


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    train_bpe(iter(["def f(x):\n    return x * 2\n", "import os\nprint('hello world')\n"] * 5), 300).save_pretrained(root)
    return str(root)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("raw")
    for k in range(8):   # distinct text per file: windows are told apart by their tokens
        (root / f"m{k}.py").write_text("".join(f"def f{k}_{j}(x):\n    return x * {j}\n" for j in range(6 + k)))
    return root


def test_the_split_and_tokens_are_those_of_prepare(tmp_path, folder, tok_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    raw = open_corpus(str(folder), tok_dir, streams=3, heldout_fraction=0.3)
    assert isinstance(raw, RawCorpus) and raw.dtype == "uint16"
    assert main(["prepare", "--input", str(folder), "--out", str(tmp_path / "p"), "--tokenizer", tok_dir,
                 "--heldout-fraction", "0.3", "--quiet"]) == 0
    prepared = TokenCorpus.open(str(tmp_path / "p"))
    assert raw.tokenizer_hash == prepared.tokenizer_hash and raw.eos_id == prepared.eos_id
    assert (raw.train_tokens, raw.heldout_tokens) == (prepared.train_tokens, prepared.heldout_tokens)
    a, b = raw.heldout_batches(4, SEQ, 3), prepared.heldout_batches(4, SEQ, 3)
    assert len(a) == len(b) > 0 and all(np.array_equal(x, y) for x, y in zip(a, b))


def test_streams_are_disjoint_and_cover_an_epoch_and_batch_i_is_found_by_reading_on(folder, tok_dir):
    raw = RawCorpus.open(str(folder), load_tokenizer(tok_dir), streams=3, seed=5, heldout_fraction=0.3)
    n = raw.train_windows(SEQ)
    epoch0 = [tuple(w) for w in raw._windows(raw._epoch_files(5, 0), SEQ)]
    assert len(epoch0) == n >= 12
    per = [len(range(q, n, 3)) for q in range(3)]
    read = {s: [tuple(r) for i in range(per[s]) for r in raw.train_batch(s, 5, i, 1, SEQ)] for s in range(3)}
    assert sorted(w for s in range(3) for w in read[s]) == sorted(epoch0)
    assert read[1] == epoch0[1::3]
    forward = [raw.train_batch(2, 5, i, 2, SEQ) for i in range(6)]  # into epoch 2: a new file order
    fresh = RawCorpus.open(str(folder), load_tokenizer(tok_dir), streams=3, seed=5, heldout_fraction=0.3)
    for i in (5, 1, 3):   # a jump forward skips, a jump back restarts the stream
        assert np.array_equal(fresh.train_batch(2, 5, i, 2, SEQ), forward[i])
    assert raw.digest == fresh.digest
    assert raw.digest != RawCorpus.open(str(folder), load_tokenizer(tok_dir), seed=6, heldout_fraction=0.3).digest


def test_raw_bad_inputs_are_one_line(tmp_path, folder, tok_dir):
    tok = load_tokenizer(tok_dir)
    with pytest.raises(TaskError, match=r"^data=.*nope-\*\.txt: no such file, or no file matches$"):
        open_corpus(str(tmp_path / "nope-*.txt"), tok)
    (tmp_path / "r.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(TaskError, match=r"records have no field 'text'"):
        open_corpus(str(tmp_path / "r.jsonl"), tok)
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / ".prepare.json").write_text("{}")   # an interrupted `ddloco data prepare`
    with pytest.raises(TaskError, match="no index.json: not a corpus made by .* did not finish"):
        open_corpus(str(tmp_path / "half"), tok)
    with pytest.raises(TaskError, match="need a tokenizer"):
        open_corpus(str(folder), None)
    with pytest.raises(TaskError, match="shorter than one batch"):
        open_corpus(str(folder), tok, heldout_fraction=0.3).check(batch_size=10_000, seq_len=SEQ)


@pytest.mark.parametrize("kind", ["jsonl", "txt"])
def test_a_single_file_holds_out_its_last_documents_like_prepare(tmp_path, tok_dir, kind):
    path = tmp_path / f"one.{kind}"
    lines = [f"line {k}: return x * {k}" for k in range(40)]
    path.write_text("".join((json.dumps({"text": t}) if kind == "jsonl" else t) + "\n" for t in lines))
    raw = open_corpus(str(path), load_tokenizer(tok_dir), heldout_fraction=0.1)
    assert main(["prepare", "--input", str(path), "--out", str(tmp_path / "p"), "--tokenizer", tok_dir,
                 "--heldout-fraction", "0.1", "--quiet"]) == 0
    prepared = TokenCorpus.open(str(tmp_path / "p"))
    assert (raw.train_tokens, raw.heldout_tokens) == (prepared.train_tokens, prepared.heldout_tokens)
    a, b = raw.heldout_batches(2, 4, 50), prepared.heldout_batches(2, 4, 50)
    assert len(a) == len(b) > 0 and all(np.array_equal(x, y) for x, y in zip(a, b))
