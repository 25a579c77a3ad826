"""Bucketed collectives against one collective per parameter, side by side in one run: the same
plan compiled twice (``disable_passes=("bucket",)`` for the unbucketed one), steps alternated
after warm-up on gloo processes, Inductor on. Prints and writes the median step times, their
ratio and the number of data-parallel collectives in each compiled step.

``python -m bench.bucketing [--steps N]`` writes bench/results/bucketing.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from autopar import launch
from bench.common import write

MODEL, BATCH, SEQ = "llama-small", 8, 128
CONFIGS = [
    {"name": "fsdp4", "pins": {"dp": 4, "fsdp": 1, "pp": 1, "tp": 1, "ac": "none", "mb": 2}},
    {"name": "ddp4", "pins": {"dp": 4, "fsdp": 0, "pp": 1, "tp": 1, "ac": "none", "mb": 2}},
    {"name": "hsdp2x2", "pins": {"dp": 4, "fsdp": 1, "dp_shard": 2, "pp": 1, "tp": 1, "ac": "none", "mb": 2}},
]


def _worker(steps: int) -> list:
    """One rank's measurements (``launch.run`` made the process group and ends it)."""
    world = dist.get_world_size()
    import autopar
    from autopar import models

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1024, (BATCH, SEQ), generator=g)
    tgt = torch.randint(0, 1024, (BATCH, SEQ), generator=g)
    out = []
    for cfg in CONFIGS:
        pms = {}
        for kind, disabled in (("bucketed", ()), ("per_parameter", ("bucket",))):
            torch.manual_seed(0)
            pms[kind] = autopar.compile(models.build_preset(MODEL, seq_len=SEQ), world, example_inputs=(ids,),
                                        plan=cfg["pins"], global_batch=BATCH, hardware="cpu", disable_passes=disabled)
        times = {k: [] for k in pms}
        for i in range(steps + 2):
            for kind, pm in pms.items():
                dist.barrier()
                t0 = time.perf_counter()
                pm.step(ids, target=tgt).item()
                if i >= 2:
                    times[kind].append(time.perf_counter() - t0)
                for p in pm.parameters():
                    p.grad = None
        counts = {k: sum(1 for r in pm.info.collectives["step"] if r["dim"] in ("dp_shard", "dp_replicate"))
                  for k, pm in pms.items()}
        out.append({"name": cfg["name"], "plan": pms["bucketed"].plan.as_config_string(),
                    **{f"{k}_s": statistics.median(v) for k, v in times.items()},
                    **{f"{k}_collectives": c for k, c in counts.items()}})
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    args = ap.parse_args()
    world = 4
    per_rank = launch.run(world, "gloo", _worker, args.steps)
    rows = []
    for i in range(len(CONFIGS)):
        r = dict(per_rank[0][i])
        r["bucketed_s"] = max(x[i]["bucketed_s"] for x in per_rank)
        r["per_parameter_s"] = max(x[i]["per_parameter_s"] for x in per_rank)
        r["ratio"] = r["bucketed_s"] / r["per_parameter_s"]
        rows.append(r)
        print(r, flush=True)
    write("bucketing", rows, {"model": MODEL, "batch": f"{BATCH} x {SEQ}", "processes": world, "steps timed": args.steps},
          ["name", "plan", "bucketed_s", "per_parameter_s", "ratio", "bucketed_collectives", "per_parameter_collectives"],
          "Bucketed vs per-parameter data-parallel collectives (gloo, Inductor on)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
