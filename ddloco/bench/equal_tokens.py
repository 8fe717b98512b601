"""Two `ddloco up` reports compared at equal tokens (e.g. a run under --chaos and the same run
without): at the smaller of their two token counts, the run that stopped there by its final eval
loss, the other by its eval curve interpolated there (an eval curve is never extrapolated).

    python -m ddloco.bench.equal_tokens reports/chaos7/report.json reports/clean0/report.json
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Sequence

from common import exits


def loss_at(curve: list[dict], tokens: float) -> float:
    """Eval loss of ``curve`` at ``tokens``, linearly interpolated (clamped at the ends)."""
    pts = sorted((float(e["tokens"]), float(e["loss"])) for e in curve)
    if tokens <= pts[0][0]:
        return pts[0][1]
    for (t0, l0), (t1, l1) in zip(pts, pts[1:]):
        if t0 <= tokens <= t1:
            return l0 if t1 == t0 else l0 + (l1 - l0) * (tokens - t0) / (t1 - t0)
    return pts[-1][1]


def main(argv: Sequence[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return exits.USAGE
    a, b = (json.loads(Path(p).read_text()) for p in argv)
    tokens = min(a["tokens_total"], b["tokens_total"])

    def at(rep: dict) -> float:
        return rep["eval_loss_final"] if rep["tokens_total"] <= tokens else loss_at(rep["eval_curve"], tokens)
    la, lb = at(a), at(b)
    out = {"tokens": tokens, "loss_first": round(la, 4), "loss_second": round(lb, 4),
           "ratio": round(la / lb, 4), "first_tokens_total": a["tokens_total"],
           "first_final": round(a["eval_loss_final"], 4), "second_tokens_total": b["tokens_total"],
           "second_final": round(b["eval_loss_final"], 4)}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
