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


def _commit() -> str:
    import subprocess

    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=os.path.dirname(__file__))
    return out.stdout.strip() or "unknown"


def main() -> int:
    """``python -m bench.parity_matrix [MODEL ...] [--only NAME[,NAME...]]``: every plan (the 4-rank
    pipeline plans included) on every model, or the named subset. The matrix takes hours on a
    2-core machine, so each run merges its cases into bench/results/parity.{md,json} (a case's
    latest result replaces its earlier one, each row dated with its commit) and the table lists
    every case of the matrix, measured or not yet."""
    args = sys.argv[1:]
    only = None
    if "--only" in args:
        i = args.index("--only")
        only = set(args[i + 1].split(","))
        args = args[:i] + args[i + 2:]
    models = args or MODELS
    all_plans = {**PLANS, **PP4}
    plans = {n: p for n, p in all_plans.items() if only is None or n in only}
    rows = []
    t0 = time.time()
    stamp = {"date": time.strftime("%Y-%m-%d"), "commit": _commit()}
    for m in models:
        cases = [{"name": f"{m}/{n}", "model": m, "plan": p} for n, p in plans.items()]
        res = dist_harness.run(4, cases)
        for i in range(len(cases)):
            rows.append({**_row([per_rank[i] for per_rank in res]), **stamp})
            print(json.dumps(rows[-1]), flush=True)
    record(rows, time.time() - t0)
    return 0 if all(r["ok"] for r in rows) else 1


def record(rows: list[dict], seconds: float) -> None:
    """Merge ``rows`` (dated cases) into bench/results/parity.{json,md}."""
    from bench.common import write

    all_plans = {**PLANS, **PP4}
    path = os.path.join(OUT, "parity.json")
    kept = {}
    if os.path.exists(path):
        with open(path) as f:
            kept = {r["case"]: r for r in json.load(f)["rows"]}
    kept.update({r["case"]: r for r in rows})
    table = [kept.get(f"{m}/{n}", {"case": f"{m}/{n}", "ok": "not run yet"}) for m in MODELS for n in all_plans]
    measured = [r for r in table if r["ok"] != "not run yet"]
    summary = {"setting": "4 gloo processes, fp32, default options (Inductor on), each case against one process",
               "columns": "grad_rel_diff: largest |autopar - one process| over every gradient after one step, relative "
                          "to the largest gradient entry when above 1; loss_diff: largest difference over three AdamW steps",
               "measured": f"{len(measured)} of {len(table)} cases ({len(rows)} in the last run, {seconds:.0f} s)",
               "all measured exact": all(r["ok"] is True for r in measured)}
    write("parity", table, summary, ["case", "plan", "grad_rel_diff", "loss_diff", "ok", "date", "commit", "error"],
          "Parity matrix (make parity): every model x every plan")


if __name__ == "__main__":
    sys.exit(main())
