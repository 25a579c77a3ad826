"""Pipeline schedules, measured beside the cost model: every schedule autopar runs (GPipe, 1F1B,
interleaved 1F1B, interleaved zero-bubble, ZBV zero-bubble) on the same model, mesh and
microbatching, over gloo processes with the default options (Inductor on).

Per schedule: the measured step time (median of the timed steps) against the predicted one for
the ``cpu-gloo`` profile, and the idle share of a pipeline rank: measured as ``1 - busy / step``,
where ``busy`` is the time spent inside the compiled stage graphs (forward, backward, and the
deferred weight-gradient graphs of the zero-bubble schedules), against the predicted
``(bubble + send/recv + schedule runtime) / step``. On CPU a graph call is synchronous, so
``busy`` is compute; idle is waiting for the neighbour stage (the bubble), send/recv, the loss
outside the graphs and the schedule's own Python.

``python -m bench.pipeline_schedules [--steps N]`` writes bench/results/pipeline_schedules.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from autopar import launch
from bench.common import write

MODEL, SEQ, MB, M = "llama-small", 128, 1, 8
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved_zb", 2), ("zbv", 2)]


def _worker(steps: int) -> list:
    """One rank's measurements (``launch.run`` made the process group and ends it)."""
    world = dist.get_world_size()
    import autopar
    from autopar import models

    g = torch.Generator().manual_seed(0)
    batch = M * MB  # dp = 1: the whole batch goes through the pipeline
    ids = torch.randint(0, 1024, (batch, SEQ), generator=g)
    tgt = torch.randint(0, 1024, (batch, SEQ), generator=g)
    out = []
    for sched, v in SCHEDULES:
        torch.manual_seed(0)
        model = models.build_preset(MODEL, seq_len=SEQ)
        pm = autopar.compile(model, world, example_inputs=(ids,), global_batch=batch, hardware="cpu",
                             plan={"pp": world, "dp": 1, "tp": 1, "mb": MB, "schedule": sched, "v": v, "ac": "none"})
        opt = torch.optim.SGD(pm.parameters(), lr=1e-3)
        runners = [r for _, r in pm._stages.values()]
        times, busy = [], []
        for i in range(steps + 2):  # two warm-up steps (Inductor compiles in the first)
            dist.barrier()
            for r in runners:
                r.busy_s = 0.0
            t0 = time.perf_counter()
            pm.step(ids, target=tgt).item()
            dt = time.perf_counter() - t0
            opt.step()
            opt.zero_grad()
            if i >= 2:
                times.append(dt)
                busy.append(sum(r.busy_s for r in runners))
        step = statistics.median(times)
        out.append({"schedule": sched, "v": v, "measured_s": step, "busy_s": statistics.median(busy),
                    "predicted_s": pm.plan.predicted["step_time_s"],
                    "predicted_idle_s": sum(pm.plan.predicted["breakdown"].get(k, 0.0)
                                            for k in ("bubble", "pp_p2p", "pp_runtime"))})
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()
    per_rank = launch.run(args.world, "gloo", _worker, args.steps)
    rows = []
    for i, (sched, v) in enumerate(SCHEDULES):
        rs = [per_rank[r][i] for r in range(args.world)]
        step = max(x["measured_s"] for x in rs)
        idle = [1 - x["busy_s"] / step for x in rs]
        pred = rs[0]
        rows.append({
            "schedule": sched, "v": v, "measured_s": step, "predicted_s": pred["predicted_s"],
            "measured/predicted": step / pred["predicted_s"],
            "idle_measured": statistics.mean(idle),
            "idle_predicted": pred["predicted_idle_s"] / pred["predicted_s"],
        })
        print(rows[-1], flush=True)
    fastest = min(rows, key=lambda r: r["measured_s"])["schedule"]
    predicted_fastest = min(rows, key=lambda r: r["predicted_s"])["schedule"]
    summary = {"model": MODEL, "processes": args.world, "pp": args.world, "microbatches": M, "mb": MB, "seq": SEQ,
               "steps timed": args.steps, "measured fastest": fastest, "predicted fastest": predicted_fastest}
    write("pipeline_schedules", rows, summary,
          ["schedule", "v", "measured_s", "predicted_s", "measured/predicted", "idle_measured", "idle_predicted"],
          "Pipeline schedules: measured vs predicted (gloo, Inductor on)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
