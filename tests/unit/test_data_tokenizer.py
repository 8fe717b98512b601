"""tokenizer_hash: the identity prepare writes and the task compares; train_bpe is deterministic."""
from __future__ import annotations

import pytest

from ddloco.data.tokenizer import load_tokenizer, tokenizer_hash, train_bpe
from common.task_args import TaskError

pytestmark = pytest.mark.timeout(30)

TEXTS = ["def f(x):\n    return x + 1\n", "the quick brown fox jumps over the lazy dog\n"] * 20


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_the_hash_survives_save_and_load_and_tells_tokenizers_apart(tmp_path):
    tok = train_bpe(iter(TEXTS), 300)
    tok.save_pretrained(tmp_path / "tok")
    loaded = load_tokenizer(str(tmp_path / "tok"))
    assert tokenizer_hash(loaded) == tokenizer_hash(tok) == tokenizer_hash(tok.backend_tokenizer)
    assert len(tokenizer_hash(tok)) == 16
    assert tokenizer_hash(train_bpe(iter(TEXTS), 300)) == tokenizer_hash(tok), "training must be deterministic"
    assert tokenizer_hash(train_bpe(iter(TEXTS), 290)) != tokenizer_hash(tok)
    assert loaded.eos_token_id == loaded.pad_token_id == loaded.bos_token_id
    loaded(["padding", "x"], padding=True)  # runtime padding settings are not part of the identity
    assert tokenizer_hash(loaded) == tokenizer_hash(tok)


def test_a_tokenizer_that_cannot_be_resolved_offline_is_one_line(tmp_path):
    with pytest.raises(TaskError) as e:
        load_tokenizer("no-such-org/no-such-tokenizer")
    assert "\n" not in str(e.value) and "no-such-org/no-such-tokenizer" in str(e.value)
    with pytest.raises(TaskError) as e:
        load_tokenizer(str(tmp_path))
    assert "\n" not in str(e.value) and "cannot load this directory" in str(e.value)


def test_a_missing_hf_extra_is_one_line_naming_the_install(monkeypatch):
    import sys
    from ddloco.data.tokenizer import require
    monkeypatch.setitem(sys.modules, "datasets", None)   # `import datasets` now raises ImportError
    with pytest.raises(TaskError) as e:
        require("datasets")
    assert str(e.value) == "datasets is not installed: pip install 'decoupled-diloco[hf]'"
