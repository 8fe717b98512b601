"""Corpora for language models: token shards made by ``ddloco data prepare`` and read in place
(``TokenCorpus``: a positioned read per window, nothing loaded whole), or raw text/json/parquet files tokenized on the fly (``open_corpus``)."""
from ddloco.data.corpus import TokenCorpus, open_corpus
from ddloco.data.tokenizer import tokenizer_hash

__all__ = ["TokenCorpus", "open_corpus", "tokenizer_hash"]
