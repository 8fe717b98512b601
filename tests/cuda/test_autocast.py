"""bf16 autocast of the learner's inner step (``learner.autocast``, learner/core.py): the forward
runs in bf16 where asked (``auto``: on CUDA only), the parameters and gradients the AdamW step
works on stay fp32."""
from __future__ import annotations

import pytest
import torch

from learner.batch_log import BatchLog
from learner.core import _Loop
from learner.inner import apply_step, make_inner_optimizer
from tests.cuda.devices import DEVICES
from tests.cuda.models import prepared_learner

pytestmark = [pytest.mark.cuda, pytest.mark.timeout(60)]


@pytest.mark.parametrize("mode", ["auto", "bf16", "off"])
@pytest.mark.parametrize("device", DEVICES)
def test_the_inner_step_runs_the_forward_in_bf16_where_asked_and_keeps_fp32_master_params(device, mode):
    learner = prepared_learner(device, autocast=mode)
    model = learner.model
    bf16 = mode == "bf16" or (mode == "auto" and device == "cuda")
    seen: dict[str, torch.dtype] = {}
    hooks = [m.register_forward_hook(lambda m, i, out, name=name: seen.__setitem__(name, out.dtype))
             for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    opt, sched = make_inner_optimizer(model.parameters(), learner.algo)
    batches = iter(learner.task.batches(0, 0, 0))
    loop = _Loop(opt, sched, batches, model, leader=True, min_steps=1, batch_log=BatchLog("", 0))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model.train()
    for _ in range(3):
        loop.ready = [next(batches)]
        loss = learner._forward_backward(loop)
        assert loss.device.type == device and loss.dtype == torch.float32 and torch.isfinite(loss)
        assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
        apply_step(model, opt, sched, learner.algo)
    for h in hooks:
        h.remove()
    assert seen == {"fc1": torch.bfloat16 if bf16 else torch.float32, "fc2": torch.bfloat16 if bf16 else torch.float32}
    for n, p in model.named_parameters():     # fp32 master parameters, on the device, trained
        assert p.dtype == torch.float32 and p.device.type == device, n
        assert not torch.equal(p.detach(), before[n]), n
    # the AdamW moments are fp32 too: a bf16 forward never narrows what the optimizer keeps
    assert all(v.dtype == torch.float32 for s in opt.state.values() for k, v in s.items()
               if torch.is_tensor(v) and k != "step")
