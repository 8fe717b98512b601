"""`ddloco up --tensorboard DIR`: the global model's eval loss as a TensorBoard scalar.

Each evaluation of the global model (the periodic ones and the final one) becomes a point of
``eval/loss`` whose step is the tokens trained by all learners, so a resumed run continues the
same curve. ``torch.utils.tensorboard`` needs the optional ``tensorboard`` package; it is
imported only when the flag is given.
"""
from __future__ import annotations

import os

MISSING = ("ddloco up --tensorboard needs the tensorboard package: "
           "pip install 'decoupled-diloco[tensorboard]'")
"""The one line `ddloco up` prints (exit 2) when the package is not installed."""

EVAL_LOSS_TAG = "eval/loss"


def tensorboard_missing() -> str | None:
    """Why ``--tensorboard`` cannot work here (``MISSING``), or None when it can."""
    try:
        import tensorboard  # noqa: F401  (torch.utils.tensorboard needs it; checked first)
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError:
        return MISSING
    return None


class TensorBoardLog:
    """Event files under ``log_dir`` with the eval loss against global tokens."""

    def __init__(self, log_dir: str | os.PathLike[str]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = os.fspath(log_dir)
        self._writer = SummaryWriter(log_dir=self.log_dir)

    def add_eval(self, tokens: int, loss: float) -> None:
        """One evaluation: ``eval/loss`` = loss at step = tokens (flushed, so it shows at once)."""
        self._writer.add_scalar(EVAL_LOSS_TAG, float(loss), global_step=int(tokens))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

    def __enter__(self) -> TensorBoardLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
