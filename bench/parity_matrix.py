"""``make parity``: the whole model x plan matrix, trained by autopar with the default options
(Inductor on) on 4 gloo processes, each case against one process. Prints a table and writes it to
bench/results/parity.md (and .json): per case the largest gradient difference after one step
(relative to the largest gradient entry when above 1), the loss difference over three AdamW steps,
or the error."""

from __future__ import annotations

import json
import os
import sys
import time

from tests import dist_harness
from tests.test_parity import GRAD_TOL, LOSS_TOL, MODELS, PLANS, PP4, TRAJ_TOL

OUT = os.path.join(os.path.dirname(__file__), "results")


def _row(per_rank: list[dict]) -> dict:
    r = per_rank[0]
    if any("error" in x for x in per_rank):
        err = next(x["error"] for x in per_rank if "error" in x)
        return {"case": r["name"], "ok": False, "error": err[:160]}
    grad = max(x["grad_max_diff"] / max(1.0, x["grad_scale"]) for x in per_rank)
    loss = max(abs(a - b) for x in per_rank for a, b in zip(x["losses"], x["ref_losses"]))
    ok = grad < GRAD_TOL and abs(r["losses"][0] - r["ref_losses"][0]) < LOSS_TOL and loss < TRAJ_TOL
    return {"case": r["name"], "plan": r["plan"], "grad_rel_diff": grad, "loss_diff": loss, "ok": ok}


def main() -> int:
    """``python -m bench.parity_matrix [MODEL ...] [--only NAME[,NAME...]]``: every plan (the 4-rank
    pipeline plans included) on every model, or the named subset."""
    args = sys.argv[1:]
    only = None
    if "--only" in args:
        i = args.index("--only")
        only = set(args[i + 1].split(","))
        args = args[:i] + args[i + 2:]
    models = args or MODELS
    plans = {n: p for n, p in {**PLANS, **PP4}.items() if only is None or n in only}
    rows = []
    t0 = time.time()
    for m in models:
        cases = [{"name": f"{m}/{n}", "model": m, "plan": p} for n, p in plans.items()]
        res = dist_harness.run(4, cases)
        for i in range(len(cases)):
            rows.append(_row([per_rank[i] for per_rank in res]))
            print(json.dumps(rows[-1]), flush=True)
    lines = ["# Parity matrix (make parity)", "",
             f"4 gloo processes, fp32, default options (Inductor on); {len(rows)} cases in {time.time() - t0:.0f} s.",
             "grad: largest |autopar - one process| over every gradient after one step, relative to the largest "
             "gradient entry when above 1; loss: largest difference over three AdamW steps.", "",
             "| case | plan | grad | loss | ok |", "|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | | | {r['error']} | no |")
        else:
            lines.append(f"| {r['case']} | {r['plan']} | {r['grad_rel_diff']:.1e} | {r['loss_diff']:.1e} | "
                         f"{'yes' if r['ok'] else 'no'} |")
    os.makedirs(OUT, exist_ok=True)
    name = "parity" if only is None and not args else "parity_partial"  # a subset never overwrites the matrix
    with open(os.path.join(OUT, f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(OUT, f"{name}.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("\n".join(lines))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
