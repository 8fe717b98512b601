"""Keep torch's compiler stack (``torch._dynamo``) out of a process that compiles nothing.

PyTorch imports ``torch._dynamo`` on the first call of several ``torch.optim.Optimizer`` methods
(``add_param_group``, so every constructor; ``zero_grad``, ``state_dict``, ``load_state_dict``)
and on every ``step``, only to tell the compiler to leave them alone or to break its graph there.
In a process where nothing is being compiled that import changes nothing, but it is the largest
single cost of a cold learner: 0.86 s on this project's idle CPU, 2.2 s on a host busy with four
other learners (``python -m ddloco.bench.rejoin``; as much as ``import torch`` itself).

``defer_compiler_import()`` makes those methods skip the import **while ``torch._dynamo`` is not
loaded**: nothing can be compiling then, so the compiler's "leave this alone" wrapper is the
identity and the graph breaks are no-ops. The moment anything imports the compiler (a task that
calls ``torch.compile``, a profiler), every method takes PyTorch's own path again, on each call.
Results are bit for bit those of the stock methods (tests/unit/test_compiler_deferral.py).

It relies on two private shapes of ``torch.optim.optimizer`` (the ``_disable_dynamo`` wrapper's
cached ``__dynamo_disable`` and ``_use_grad_for_differentiable``'s wrapper); where a torch
version lacks either, nothing is changed and the import simply happens as before.
"""
from __future__ import annotations

import functools
import sys
import threading
from typing import Any, Callable

import torch

COMPILER = "torch._dynamo"
_lock = threading.Lock()
_done: int | None = None


def _compiler_loaded() -> bool:
    return COMPILER in sys.modules


def _probe_code(make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Any:
    """The code object every wrapper made by ``make`` shares (None where ``make`` is missing)."""
    try:
        return make(lambda *a, **k: None).__code__
    except Exception:  # noqa: BLE001  (a torch whose private helpers differ: change nothing)
        return None


def _skip_disable(wrapper: Callable[..., Any]) -> bool:
    """A ``torch._disable_dynamo`` wrapper calls its function directly while the compiler is not
    loaded (it caches the compiler's ``disable`` on the function as ``__dynamo_disable``)."""
    cells = dict(zip(wrapper.__code__.co_freevars, (c.cell_contents for c in wrapper.__closure__ or ())))
    fn, recursive = cells.get("fn"), cells.get("recursive")
    if not callable(fn) or not isinstance(recursive, bool) or getattr(fn, "__dynamo_disable", None) is not None:
        return False

    def until_compiler(*args: Any, **kwargs: Any) -> Any:
        if not _compiler_loaded():
            return fn(*args, **kwargs)
        import torch._dynamo  # noqa: F401  (loaded already: a dictionary lookup)
        disabled = torch._dynamo.disable(fn, recursive, wrapping=False)
        fn.__dynamo_disable = disabled   # from now on PyTorch's own path, uncached by us
        return disabled(*args, **kwargs)
    fn.__dynamo_disable = until_compiler
    return True


def _skip_graph_breaks(cls: type, name: str, wrapper: Callable[..., Any]) -> bool:
    """An optimizer's ``step`` wrapped by ``_use_grad_for_differentiable``: the same grad mode
    around the step, without the compiler's graph breaks, while the compiler is not loaded."""
    step = getattr(wrapper, "__wrapped__", None)
    if not callable(step):
        return False

    def without_graph_breaks(*args: Any, **kwargs: Any) -> Any:
        if _compiler_loaded():
            return wrapper(*args, **kwargs)
        before = torch.is_grad_enabled()
        try:
            torch.set_grad_enabled(args[0].defaults["differentiable"])
            return step(*args, **kwargs)
        finally:
            torch.set_grad_enabled(before)
    functools.update_wrapper(without_graph_breaks, step)
    setattr(cls, name, without_graph_breaks)
    return True


def _optimizer_classes() -> list[type]:
    out, todo = [], [torch.optim.Optimizer]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo.extend(cls.__subclasses__())
    return out


def defer_compiler_import() -> int:
    """Make torch's optimizers skip importing the compiler until something else imports it
    (idempotent; call before the first optimizer is built). Returns how many methods changed
    (0: the compiler is loaded already, or this torch's private helpers differ)."""
    global _done
    with _lock:
        if _done is not None:
            return _done
        _done = 0
        if _compiler_loaded():
            return 0
        from torch import _compile
        from torch.optim import optimizer
        disable_code = _probe_code(getattr(_compile, "_disable_dynamo", None) or (lambda f: None))
        use_grad_code = _probe_code(getattr(optimizer, "_use_grad_for_differentiable", None) or (lambda f: None))
        for cls in _optimizer_classes():
            for name, attr in list(vars(cls).items()):
                code = getattr(attr, "__code__", None)
                if code is None:
                    continue
                if code is disable_code:
                    _done += _skip_disable(attr)
                elif code is use_grad_code:
                    _done += _skip_graph_breaks(cls, name, attr)
        return _done
