"""`--task hf` end to end: `ddloco up` trains a tiny Llama, writes DIR/hf, and a plain script
(transformers, torch and numpy only) reproduces the report's final eval loss from it; `ddloco
export --format hf` from checkpoints and from a live run; bad inputs refused before Redis."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from common import control  # noqa: E402
from common.config import Endpoints, RunConfig, TaskConfig  # noqa: E402
from common.keys import Keys  # noqa: E402
from common.redis_server import free_port  # noqa: E402
from tests.conftest import start_guarded, wait_until  # noqa: E402
from tests.hf_corpus import TINY_CONFIG, make_corpus, make_tokenizer, offline_env  # noqa: E402

pytestmark = pytest.mark.timeout(180)
REPO = Path(__file__).resolve().parents[2]
SEQ_LEN, BATCH, EVAL_BATCHES = 32, 8, 4

PLAIN_SCRIPT = r'''
import json, sys
import numpy as np, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
model_dir, corpus, seq_len, batch_size, eval_batches = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
tok = AutoTokenizer.from_pretrained(model_dir)
index = json.load(open(f"{corpus}/index.json"))
windows = []   # the held-out windows: each held-out shard in index order, cut in seq_len + 1 tokens
for shard in index["heldout"]:
    ids = np.fromfile(f"{corpus}/{shard['file']}", dtype=index["dtype"])
    windows += [ids[w * (seq_len + 1):(w + 1) * (seq_len + 1)] for w in range(len(ids) // (seq_len + 1))]
windows = windows[:batch_size * eval_batches]
losses = []
with torch.no_grad():
    for i in range(0, len(windows), batch_size):   # the mean over batches of each batch's mean loss
        batch = torch.from_numpy(np.stack(windows[i:i + batch_size]).astype(np.int64))
        logits = model(input_ids=batch[:, :-1]).logits
        losses.append(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                                        batch[:, 1:].reshape(-1)).item())
print(json.dumps({"loss": sum(losses) / len(losses), "vocab": len(tok), "text": tok.decode(tok("x = 1")["input_ids"])}))
'''


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hfrun")
    return make_corpus(root / "corpus", make_tokenizer(root / "tok"))


def task_args(corpus: Path, **extra: str) -> list[str]:
    items = {"model": "llama", "data": str(corpus), "seq_len": str(SEQ_LEN), "batch_size": str(BATCH),
             "eval_batches": str(EVAL_BATCHES), **TINY_CONFIG, **extra}
    return [x for k, v in items.items() for x in ("--task-arg", f"{k}={v}")]


def env() -> dict[str, str]:
    return {**offline_env(), "PYTHONPATH": str(REPO)}


def cli(*argv: str) -> tuple[int, str]:
    """`ddloco ARGV` in this process (the command line's own code path, without ~3 s of imports)."""
    from ddloco.cli import main
    threads = torch.get_num_threads()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        rc = main(list(argv))
    except SystemExit as e:
        rc = int(e.code or 0)
    finally:   # what a daemon's main sets for its process
        torch.set_num_threads(threads)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return rc, ""


def test_up_writes_an_hf_model_whose_plain_transformers_eval_loss_is_the_reports(corpus, tmp_path, capsys):
    from transformers import AutoModelForCausalLM
    report = tmp_path / "R"
    res = subprocess.run([sys.executable, "-m", "ddloco", "up", "--task", "hf", *task_args(corpus), "--learners", "2",
                          "--syncers", "2", "--steps", "16", "--minutes", "2", "--eval-every-s", "600",
                          "--report", str(report), "--run-id", "hf-e2e"],
                         capture_output=True, text=True, cwd=tmp_path, env=env(), timeout=150)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rep = json.loads((report / "report.json").read_text())
    assert rep["eval_loss_final"] < rep["eval_loss_initial"], (rep["eval_loss_initial"], rep["eval_loss_final"])
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (report / "hf").iterdir()}
    # a plain script, none of our code: the report's final eval loss from DIR/hf and the corpus files
    plain = subprocess.run([sys.executable, "-c", PLAIN_SCRIPT, str(report / "hf"), str(corpus), str(SEQ_LEN),
                            str(BATCH), str(EVAL_BATCHES)], capture_output=True, text=True, env=offline_env(),
                           cwd=tmp_path, timeout=60)
    assert plain.returncode == 0, plain.stderr[-2000:]
    out = json.loads(plain.stdout.strip().splitlines()[-1])
    assert abs(out["loss"] - rep["eval_loss_final"]) < 1e-3, (out, rep["eval_loss_final"])
    assert out["vocab"] == 300 and out["text"] == "x = 1"
    # greedy samples at each evaluation: report.json, samples.md, the progress lines
    curve = rep["eval_curve"]
    assert curve[0]["tokens"] == 0 and curve[-1].get("final") and len(curve) >= 2
    assert all(len(e["samples"]) == 3 and all(" || " in s for s in e["samples"]) for e in curve), curve
    assert "# Samples of the global model" in (report / "samples.md").read_text()
    assert res.stdout.count("sample     ") >= 6, res.stdout[-3000:]
    # `ddloco export --format hf` from the shards' checkpoints: the same model as DIR/hf
    out_dir = tmp_path / "exported"
    rc, _ = cli("export", "--format", "hf", "--checkpoint-dir", rep["checkpoint_dir"] if os.path.isabs(
        rep["checkpoint_dir"]) else str(tmp_path / rep["checkpoint_dir"]), "--out", str(out_dir))
    assert rc == 0, capsys.readouterr().err
    a = AutoModelForCausalLM.from_pretrained(str(report / "hf")).state_dict()
    b = AutoModelForCausalLM.from_pretrained(str(out_dir)).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # a task without save refuses --format hf in one line (here: the same hf task with its hook removed)
    (tmp_path / "nosave.py").write_text("import dataclasses\nfrom common.task import load_task\n"
                                        "def task(**kw):\n    return dataclasses.replace(load_task('hf', kw), save=None)\n")
    sys.path.insert(0, str(tmp_path))
    try:
        capsys.readouterr()
        rc, _ = cli("export", "--format", "hf", "--checkpoint-dir", str(Path(rep["checkpoint_dir"]).resolve()
                    if os.path.isabs(rep["checkpoint_dir"]) else tmp_path / rep["checkpoint_dir"]),
                    "--task", "nosave:task", *task_args(corpus), "--out", str(tmp_path / "refused"))
    finally:
        sys.path.remove(str(tmp_path))
    err = capsys.readouterr().err
    assert rc == 2 and "--format hf: task 'hf' has no save hook" in err and err.count("\n") == 1, err
    assert not (tmp_path / "refused").exists()


def test_export_format_hf_from_a_live_run(corpus, tmp_path, redis_server, capsys):
    """Two shards of an hf run in threads, no learner: the live global model is the initial one."""
    import ddloco
    from transformers import AutoModelForCausalLM

    from common.task import bind_task, build_model
    items = dict(a.split("=", 1) for a in task_args(corpus)[1::2])
    task, run = bind_task(RunConfig(task=TaskConfig(spec="hf", args=items)))
    ep = Endpoints(run_id="live", redis_url=redis_server.url, broker_pub=f"tcp://127.0.0.1:{free_port()}",
                   broker_sub=f"tcp://127.0.0.1:{free_port()}")
    stop, errors = threading.Event(), []
    threads = [start_guarded(errors, ddloco.run_broker, endpoints=ep, stop=stop)]
    threads += [start_guarded(errors, ddloco.run_shard, task=task, endpoints=ep, run=run, stop=stop, shard=k, shards=2,
                                options=ddloco.SyncerOptions(checkpoint_dir="", initial_step_time_s=0.02))
                for k in range(2)]
    try:
        r = control.connect(redis_server.url)
        wait_until(lambda: len(control.shard_table(r, Keys("live"))) == 2 or errors, 60, what="two shards up")
        assert not errors, errors
        rc, _ = cli("export", "--format", "hf", "--redis-url", redis_server.url, "--run-id", "live",
                    "--out", str(tmp_path / "live"))
        assert rc == 0, capsys.readouterr().err
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=10)
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "live")).state_dict()
    initial = build_model(task, run.task.seed).state_dict()
    assert all(torch.equal(loaded[k], initial[k]) for k in loaded), "the live export is not the shards' model"


BAD_INPUTS = [
    ("learner", {"model": "no-such-org/no-such-model"}, "model 'no-such-org/no-such-model' cannot be resolved offline"),
    ("learner", {"config.vocab_size": "100"}, "more than the model's embedding (vocab_size=100)"),
    ("learner", {"batch_size": "100000"}, "shorter than one batch of 100000"),
    ("learner", {"tokenizer": "OTHER"}, "its shards were made with another tokenizer"),
    ("up", {"seq_len": "200"}, "seq_len=200 is above the model's max_position_embeddings=128"),
    ("up", {"data": "JSONL", "tokenizer": "TOK", "text_field": "body"}, "its records have no field 'body'"),
]


def test_bad_inputs_exit_2_with_one_line_before_anything_is_written_to_redis(corpus, tmp_path, redis_server,
                                                                            capsys, monkeypatch):
    other = make_tokenizer(tmp_path / "other", vocab_size=280)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": f"line {i} of text " * 20}) + "\n"
                                                 for i in range(50)))
    places = {"OTHER": str(other), "JSONL": str(tmp_path / "docs.jsonl"), "TOK": str(corpus / "tokenizer")}
    net = ["--insecure", "--redis-url", redis_server.url, "--run-id", "bad", "--broker-pub",
           f"tcp://127.0.0.1:{free_port()}", "--broker-sub", f"tcp://127.0.0.1:{free_port()}"]
    monkeypatch.chdir(tmp_path)
    for command, extra, needle in BAD_INPUTS:
        extra = {k: places.get(v, v) for k, v in extra.items()}
        more = ["--learners", "2", "--syncers", "2", "--steps", "5"] if command == "up" else []
        capsys.readouterr()
        rc, _ = cli(command, *net, "--task", "hf", *task_args(corpus, **extra), *more)
        err = capsys.readouterr().err
        lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("{")]   # not the JSON logs
        assert rc == 2, (command, extra, err[-1500:])
        assert needle in err and "Traceback" not in err and len(lines) == 1, (command, extra, err[-1500:])
        assert control.connect(redis_server.url).keys("*") == [], f"{command} {extra} wrote to Redis"
    assert not (tmp_path / "runs").exists()
