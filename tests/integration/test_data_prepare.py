"""`ddloco data prepare` as a user runs it: real files, a real process killed with SIGKILL and run
again, json/parquet through `datasets`, bad inputs as one line and exit 2."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from ddloco.data import TokenCorpus, open_corpus
from ddloco.data.cli import main
from tests.conftest import wait_until

pytestmark = pytest.mark.timeout(60)

TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n    y: int = 0\n"


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> str:
    """A byte-level BPE saved as an HF tokenizer directory, made with `tokenizers` alone."""
    import tokenizers
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator([TEXT] * 10, tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    root = tmp_path_factory.mktemp("tok")
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}))
    return str(root)


def text_folder(root: Path, n: int) -> Path:
    root.mkdir()
    for k in range(n):
        (root / f"f{k:02d}.py").write_text(f"# file {k}\n" + TEXT * (1 + k % 3))
    return root


def files_of(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def done_inputs(out: Path) -> int:
    """Inputs finished: their parts, each renamed into OUT/.parts when whole."""
    return len(list((out / ".parts").glob("[0-9]*.bin")))


def feed(fifo: Path, text: str, out: Path, after: int) -> threading.Thread:
    """Write ``text`` into a named pipe once the prepare process making ``out`` finished ``after``
    inputs (it is then reading the pipe, its last input)."""
    def write() -> None:
        wait_until(lambda: done_inputs(out) >= after, what=f"{after} inputs done in {out}")
        fifo.write_text(text)
    t = threading.Thread(target=write, daemon=True)
    t.start()
    return t


def _ctrl_c_as_at_a_terminal() -> None:
    """The child takes SIGINT by default even where the suite itself was started with it ignored
    (a non-interactive shell's background job, `cmd &`: inherited, Python then installs no
    KeyboardInterrupt handler and the test's Ctrl-C would do nothing)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def prepare_process(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ddloco", "data", "prepare", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_ctrl_c_as_at_a_terminal)


def test_a_killed_prepare_run_again_finishes_byte_identical(tmp_path, tokenizer_dir):
    inputs = text_folder(tmp_path / "in", 12)
    fifo = inputs / "zz-last.txt"   # read last: the process blocks there until the test writes it
    os.mkfifo(fifo)
    args = ["--input", str(inputs), "--tokenizer", tokenizer_dir, "--heldout-fraction", "0.2"]
    feeder = feed(fifo, TEXT * 5, tmp_path / "ref", 12)
    ref = prepare_process(*args, "--out", str(tmp_path / "ref"))
    assert ref.wait(30) == 0, ref.stderr.read()
    feeder.join(5)

    out = tmp_path / "out"
    killed = prepare_process(*args, "--out", str(out))
    wait_until(lambda: done_inputs(out) == 12, what="12 of 13 inputs finished, the process waiting on the last one")
    killed.send_signal(signal.SIGKILL)
    assert killed.wait(10) == -signal.SIGKILL
    assert not (out / "index.json").exists()

    feeder = feed(fifo, TEXT * 5, out, 12)
    again = prepare_process(*args, "--out", str(out))
    stdout, stderr = again.communicate(timeout=30)
    assert again.returncode == 0, stderr
    feeder.join(5)
    assert "12 of 13 input file(s) already done" in stderr
    assert files_of(out) == files_of(tmp_path / "ref")
    assert TokenCorpus.open(str(out)).train_tokens > 0


def test_ctrl_c_is_one_line_exit_130_and_the_same_command_goes_on(tmp_path, tokenizer_dir):
    inputs = text_folder(tmp_path / "in", 3)
    os.mkfifo(inputs / "zz-last.txt")
    args = ["--input", str(inputs), "--tokenizer", tokenizer_dir, "--out", str(tmp_path / "out")]
    proc = prepare_process(*args)
    wait_until(lambda: done_inputs(tmp_path / "out") == 3, what="3 of 4 inputs finished")
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=10)
    assert proc.returncode == 130 and stderr.strip().splitlines()[-1] == (
        "ddloco data prepare: interrupted; run the same command again to go on where it stopped"), stderr
    assert not (tmp_path / "out" / "index.json").exists()
    feeder = feed(inputs / "zz-last.txt", TEXT, tmp_path / "out", 3)
    again = prepare_process(*args)
    _, stderr = again.communicate(timeout=30)
    feeder.join(5)
    assert again.returncode == 0 and "3 of 4 input file(s) already done" in stderr, stderr


def test_other_options_on_an_existing_out_are_refused_naming_them(tmp_path, tokenizer_dir, capsys):
    inputs = text_folder(tmp_path / "in", 4)
    out = str(tmp_path / "out")
    assert main(["prepare", "--input", str(inputs), "--out", out, "--tokenizer", tokenizer_dir, "--quiet"]) == 0
    before = files_of(Path(out))
    assert main(["prepare", "--input", str(inputs), "--out", out, "--tokenizer", tokenizer_dir, "--quiet"]) == 0
    assert files_of(Path(out)) == before, "the same command again finds it finished"
    capsys.readouterr()
    assert main(["prepare", "--input", str(inputs), "--out", out, "--tokenizer", tokenizer_dir, "--seed", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "seed was 0, now 3" in err and "use another --out or delete it" in err
    assert main(["prepare", "--input", str(inputs), "--out", out, "--train-tokenizer", "280"]) == 2
    assert "tokenizer was" in capsys.readouterr().err
    (inputs / "f00.py").write_text("changed")
    (inputs / "new.py").write_text("new")
    assert main(["prepare", "--input", str(inputs), "--out", out, "--tokenizer", tokenizer_dir]) == 2
    err = capsys.readouterr().err
    assert f"inputs differ: new 1 (first {inputs / 'new.py'}), changed size 1 (first {inputs / 'f00.py'})" in err
    assert files_of(Path(out)) == before
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    assert main(["prepare", "--input", str(inputs), "--out", str(tmp_path / "other"), "--tokenizer",
                 tokenizer_dir]) == 2
    assert "is not a corpus made by `ddloco data prepare`" in capsys.readouterr().err


def test_records_through_datasets_are_documents_and_shards_have_a_bounded_size(tmp_path, tokenizer_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq
    inputs = tmp_path / "in"
    inputs.mkdir()
    docs = [f"doc {k}: " + TEXT * (k % 4) for k in range(30)]
    (inputs / "a.jsonl").write_text("".join(json.dumps({"body": d, "id": k}) + "\n" for k, d in enumerate(docs[:20])))
    pq.write_table(pa.table({"body": docs[20:]}), inputs / "b.parquet")
    base = ["prepare", "--input", str(inputs / "*.jsonl"), str(inputs / "*.parquet"), "--tokenizer", tokenizer_dir,
            "--text-field", "body", "--heldout-fraction", "0", "--quiet"]
    assert main([*base, "--out", str(tmp_path / "one")]) == 0
    assert main([*base, "--out", str(tmp_path / "many"), "--shard-tokens", "100"]) == 0
    one, many = TokenCorpus.open(str(tmp_path / "one")), json.loads((tmp_path / "many" / "index.json").read_text())
    assert len(many["train"]) > 3 and all(s["tokens"] <= 100 for s in many["train"])
    joined = np.concatenate([np.fromfile(tmp_path / "many" / s["file"], dtype=np.uint16) for s in many["train"]])
    single = np.fromfile(tmp_path / "one" / "train-00000.bin", dtype=np.uint16)
    assert np.array_equal(joined, single)
    import tokenizers
    tok = tokenizers.Tokenizer.from_file(os.path.join(tokenizer_dir, "tokenizer.json"))
    expected = [i for d in docs for i in [*tok.encode(d, add_special_tokens=False).ids, one.eos_id]]
    assert single.tolist() == expected, "a record is a document followed by eos, in file order"
    assert one.dtype == "uint16" and one.heldout_tokens == 0


def test_workers_make_the_same_corpus(tmp_path, tokenizer_dir):
    inputs = text_folder(tmp_path / "in", 6)
    base = ["prepare", "--input", str(inputs), "--tokenizer", tokenizer_dir, "--quiet", "--heldout-fraction", "0.3"]
    assert main([*base, "--out", str(tmp_path / "one")]) == 0
    assert main([*base, "--out", str(tmp_path / "two"), "--workers", "2"]) == 0
    assert files_of(tmp_path / "one") == files_of(tmp_path / "two")


def test_a_single_input_holds_out_its_last_documents(tmp_path, tokenizer_dir):
    path = tmp_path / "one.jsonl"
    path.write_text("".join(json.dumps({"text": f"record {k} " + TEXT}) + "\n" for k in range(50)))
    assert main(["prepare", "--input", str(path), "--out", str(tmp_path / "out"), "--tokenizer", tokenizer_dir,
                 "--heldout-fraction", "0.1", "--quiet"]) == 0
    c = TokenCorpus.open(str(tmp_path / "out"))
    held = np.fromfile(tmp_path / "out" / "heldout-00000.bin", dtype=np.uint16)
    assert int((held == c.eos_id).sum()) == 5 and held[-1] == c.eos_id
    train = np.fromfile(tmp_path / "out" / "train-00000.bin", dtype=np.uint16)
    assert int((train == c.eos_id).sum()) == 45 and train[-1] == c.eos_id
    assert open_corpus(str(tmp_path / "out")).digest == c.digest
    assert c.tokenizer_dir == str(tmp_path / "out" / "tokenizer")


@pytest.mark.parametrize("case", ["no match", "missing field", "tokenizer", "tiny vocabulary"])
def test_bad_input_is_one_line_and_exit_2_and_writes_nothing(tmp_path, tokenizer_dir, case, capsys):
    good, other = tmp_path / "a.txt", tmp_path / "a.jsonl"
    good.write_text(TEXT)
    other.write_text(json.dumps({"content": "x"}) + "\n")
    args, want = {
        "no match": (["--input", str(tmp_path / "nothing-*.txt"), "--tokenizer", tokenizer_dir],
                     "nothing-*.txt: no such file, or no file matches"),
        "missing field": (["--input", str(other), "--tokenizer", tokenizer_dir],
                          "its records have no field 'text' (fields: content; use --text-field)"),
        "tokenizer": (["--input", str(good), "--tokenizer", "no-such-org/no-such-tokenizer"],
                      "tokenizer 'no-such-org/no-such-tokenizer': cannot load this name"),
        "tiny vocabulary": (["--input", str(good), "--train-tokenizer", "100"], "at least 258")}[case]
    assert main(["prepare", *args, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ddloco data prepare: ") and want in err, err
    assert not (tmp_path / "out").exists()


def test_one_tokenizer_option_is_required(tmp_path, tokenizer_dir, capsys):
    for extra in (["--tokenizer", tokenizer_dir, "--train-tokenizer", "300"], []):
        with pytest.raises(SystemExit) as e:
            main(["prepare", "--input", str(tmp_path), "--out", str(tmp_path / "out"), *extra])
        assert e.value.code == 2
    assert not (tmp_path / "out").exists()


def test_a_trained_tokenizer_is_saved_as_an_hf_directory_that_matches_the_index(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from ddloco.data.tokenizer import load_tokenizer, tokenizer_hash
    inputs = text_folder(tmp_path / "in", 5)
    for name in ("a", "b"):
        assert main(["prepare", "--input", str(inputs), "--out", str(tmp_path / name), "--train-tokenizer", "300",
                     "--quiet"]) == 0
    index = json.loads((tmp_path / "a" / "index.json").read_text())
    tok = load_tokenizer(str(tmp_path / "a" / "tokenizer"))
    assert tokenizer_hash(tok) == index["tokenizer"]["hash"] and len(tok) == index["tokenizer"]["vocab_size"] <= 300
    assert tok.eos_token_id == tok.bos_token_id == tok.pad_token_id == index["eos_id"]
    assert files_of(tmp_path / "a") == files_of(tmp_path / "b"), "training the tokenizer is deterministic"


def test_an_out_inside_the_input_folder_is_not_read_as_input(tmp_path, tokenizer_dir):
    inputs = text_folder(tmp_path / "in", 3)
    args = ["prepare", "--input", str(inputs), "--out", str(inputs / "tokens"), "--tokenizer", tokenizer_dir, "--quiet"]
    assert main(args) == 0
    before = files_of(inputs / "tokens")
    assert main(args) == 0, "its own shards would have changed the inputs"
    assert files_of(inputs / "tokens") == before
    assert [i["path"] for i in json.loads((inputs / "tokens" / "index.json").read_text())["inputs"]] == [
        "f00.py", "f01.py", "f02.py"]


@pytest.mark.parametrize("fraction", ["0.1", "0"])
def test_a_single_input_stopped_before_its_shards_resumes_from_its_part(tmp_path, tokenizer_dir, fraction,
                                                                         monkeypatch, capsys):
    from ddloco.data import prepare as prepare_module
    path = tmp_path / "one.jsonl"
    path.write_text("".join(json.dumps({"text": f"record {k} " + TEXT}) + "\n" for k in range(30)))
    args = ["prepare", "--input", str(path), "--tokenizer", tokenizer_dir, "--heldout-fraction", fraction]
    assert main([*args, "--out", str(tmp_path / "ref"), "--quiet"]) == 0
    real = prepare_module._assemble

    def stopped(*a, **kw):   # the process dies after encoding, before its shards
        raise KeyboardInterrupt
    monkeypatch.setattr(prepare_module, "_assemble", stopped)
    assert main([*args, "--out", str(tmp_path / "out")]) == 130
    assert list((tmp_path / "out" / ".parts").glob("[0-9]*.bin"))
    monkeypatch.setattr(prepare_module, "_assemble", real)
    capsys.readouterr()
    assert main([*args, "--out", str(tmp_path / "out")]) == 0
    assert "1 of 1 input file(s) already done" in capsys.readouterr().err
    assert files_of(tmp_path / "out") == files_of(tmp_path / "ref")
