"""learner.compiler_deferral: torch's optimizers without torch's compiler stack, bit for bit.

Each case runs in a fresh interpreter (the deferral changes process-wide torch classes, and this
test process may have imported the compiler already)."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from common.config import AlgoConfig
    defer = sys.argv[1] == "defer"
    if defer:
        from learner.compiler_deferral import defer_compiler_import
        changed = defer_compiler_import()
    else:
        changed = 0
    from learner.inner import apply_step, load_optimizer_state, make_inner_optimizer
    from learner import inner
    if not defer:
        inner.defer_compiler_import = lambda: 0     # the stock torch path, for comparison
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    algo = AlgoConfig(inner_warmup_steps=3, inner_grad_clip=0.5)
    opt, sched = make_inner_optimizer(model.parameters(), algo)
    for step in range(6):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        apply_step(model, opt, sched, algo)
        opt.zero_grad(set_to_none=True)
    state = opt.state_dict()
    opt2, _ = make_inner_optimizer(model.parameters(), algo)
    load_optimizer_state(opt2, state)
    out = {"changed": changed, "compiler": "torch._dynamo" in sys.modules,
           "params": [p.detach().flatten().tolist() for p in model.parameters()],
           "moments": [opt2.state[p]["exp_avg_sq"].flatten().tolist() for p in model.parameters()],
           "lr": opt.param_groups[0]["lr"]}
    if sys.argv[2] == "then-compile":   # something imports the compiler: torch's own path again
        import torch._dynamo
        compiled = torch.compile(model, backend="eager")
        compiled(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        wrapped = type(opt).zero_grad.__wrapped__
        out["after"] = getattr(wrapped, "__dynamo_disable").__name__ != "until_compiler"
    print(json.dumps(out))
""")


def _run(mode: str, then: str = "-") -> dict:
    p = subprocess.run([sys.executable, "-c", SCRIPT, mode, then], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_training_never_imports_the_compiler_and_matches_torch_bit_for_bit():
    deferred, stock = _run("defer"), _run("stock")
    assert deferred["changed"] >= 5          # add_param_group, zero_grad, state_dict, load_state_dict, step
    assert deferred["compiler"] is False
    assert stock["compiler"] is True         # what torch does by itself (the cost this saves)
    for key in ("params", "moments", "lr"):
        assert deferred[key] == stock[key], key


def test_once_the_compiler_is_loaded_torch_takes_its_own_path():
    out = _run("defer", "then-compile")
    assert out["compiler"] is False and out["after"] is True


def test_nothing_changes_when_the_compiler_is_loaded_already():
    code = ("import torch._dynamo\nfrom learner.compiler_deferral import defer_compiler_import\n"
            "print(defer_compiler_import())")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "0"
