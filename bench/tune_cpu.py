"""Cost model against measurement on this machine (CPU processes over gloo), before and after
``autopar tune calibrate --model llama-small`` (microbenchmarks, then efficiencies fitted to the
model's operators at each world size's share of the batch): for 2 and 4 processes, a fixed set of at least 6 different plans of a
small Llama is measured (eager, warm-up excluded) and predicted with the uncalibrated ``cpu-gloo``
profile and with the calibrated one. Reported: median |predicted/measured - 1|, Spearman rank
correlation, and whether the tuned choice is the measured fastest.

Targets (issue 4): after calibration, median error <= 15% and Spearman >= 0.8.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys

import torch

from bench.common import RESULTS, write

MODEL, SEQ, BATCH = "llama-small", 256, 8
PLANS = {
    2: ["dp=2,fsdp=1,pp=1", "dp=2,fsdp=0,pp=1", "tp=2,sp=0,pp=1", "tp=2,sp=1,pp=1", "pp=2,schedule=1f1b,mb=2",
        "pp=2,schedule=gpipe,mb=1", "dp=2,fsdp=1,pp=1,ac=full", "pp=2,schedule=interleaved,v=2,mb=2"],
    4: ["dp=4,fsdp=1,pp=1", "dp=4,fsdp=0,pp=1", "tp=4,sp=0,pp=1", "tp=4,sp=1,pp=1", "tp=2,dp=2,fsdp=1,sp=1,pp=1",
        "pp=2,dp=2,fsdp=0,schedule=1f1b,mb=1", "pp=4,schedule=1f1b,mb=2", "tp=2,pp=2,sp=0,schedule=1f1b,mb=2"],
}


def _measure_rank(world: int, pins: list[str], steps: int):
    from autopar import api, models, tune

    torch.manual_seed(0)
    ids = torch.randint(0, 1024, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    out = []
    for pin in pins:
        plan = api.plan(models.build_preset(MODEL), world, example_inputs=(ids,), hardware="cpu-gloo",
                        global_batch=BATCH, pin=pin + ("" if "ac=" in pin else ",ac=none"))
        m = tune.measure_plan(lambda: models.build_preset(MODEL), plan, (ids,), steps=steps, compile=False)
        out.append({"pin": pin, "plan": plan.to_json(), "measured_s": m["step_time_s"],
                    "peak_memory_gb": m["peak_memory_gb"]})
    return out


@functools.lru_cache(maxsize=1)
def _profile():
    from autopar import api

    return api.profile_model(MODEL, seq_len=SEQ, precision="fp32").profile


def _predict(plan_json: str, profile) -> float:
    """The plan as measured (eager, fp32, its AC) priced with ``profile``."""
    from autopar import api
    from autopar.cost_models.step import Config, CostContext, StageModel, uniform_assignment
    from autopar.plan import Plan

    p = Plan.from_json(plan_json)
    ctx = CostContext(_profile(), api.load_hardware(profile), BATCH, "fp32", compiled=False)
    cfg = Config(p.tp, p.pp, p.dp, p.dp_shard, p.sp, p.fsdp, p.reshard_after_forward, p.mb,
                 p.schedule if p.pp > 1 else "1f1b", p.v)
    sm = StageModel(ctx, cfg)
    return sm.evaluate(uniform_assignment(sm, p.layers[0].ac)).step_time_s


def _calibrate(world: int) -> dict:
    """Microbenchmarks plus the model's own operators at this world's share of the batch."""
    from autopar import launch, tune

    return launch.run(world, "gloo", tune.calibrate_rank, "cpu-gloo", 4 << 20, 3, MODEL,
                      max(1, BATCH // world), SEQ)[0].profile


def _summarise(rows: list[dict], profiles: dict) -> dict:
    from autopar import tune

    summary = {}
    for r in rows:
        r["before_s"] = _predict(r["plan"], "cpu-gloo")
        r["after_s"] = _predict(r["plan"], profiles[str(r["world"])])
        r["before_err"] = r["before_s"] / r["measured_s"] - 1
        r["after_err"] = r["after_s"] / r["measured_s"] - 1
    for world in sorted({r["world"] for r in rows}):
        sub = [r for r in rows if r["world"] == world]
        meas = [r["measured_s"] for r in sub]
        for tag in ("before", "after"):
            summary[f"world {world} median |error| {tag} calibration"] = (
                f"{statistics.median(abs(r[f'{tag}_err']) for r in sub) * 100:.1f}%")
            summary[f"world {world} Spearman {tag} calibration"] = f"{tune.spearman([r[f'{tag}_s'] for r in sub], meas):.2f}"
        best_pred = min(sub, key=lambda r: r["after_s"])
        best_meas = min(sub, key=lambda r: r["measured_s"])
        summary[f"world {world} calibrated planner's pick is measured fastest"] = (
            f"{best_pred['pin'] == best_meas['pin']} (pick {best_pred['pin']}, fastest {best_meas['pin']})")
        prof = profiles[str(world)]
        summary[f"world {world} calibrated profile"] = json.dumps(
            {k: prof[k] for k in ("peak_tflops", "memory_bandwidth_gbps", "launch_us")} | {"efficiency": prof["efficiency"]})
    return summary


def main(argv=None) -> int:
    """``--reprice``: keep the stored measurements and calibrated profiles, price them again with
    the current cost model (to check a cost-model change without measuring again);
    ``--recalibrate``: keep the stored measurements, calibrate again."""
    from autopar import launch

    argv = sys.argv[1:] if argv is None else argv
    path = os.path.join(RESULTS, "tune_cpu.json")
    if "--reprice" in argv or "--recalibrate" in argv:
        with open(path) as f:
            stored = json.load(f)
        rows, profiles = stored["rows"], stored["profiles"]
        if "--recalibrate" in argv:
            profiles = {str(w): _calibrate(w) for w in (2, 4)}
    else:
        rows, profiles = [], {}
        for world in (2, 4):
            profiles[str(world)] = _calibrate(world)
            for r in launch.run(world, "gloo", _measure_rank, world, PLANS[world], 3)[0]:
                rows.append({"world": world, **r})
    summary = _summarise(rows, profiles)
    for r in rows:
        print(f"world {r['world']} {r['pin']:40s} measured {r['measured_s']:.3f}s  before {r['before_s']:.3f}s "
              f"({r['before_err'] * 100:+.0f}%)  after {r['after_s']:.3f}s ({r['after_err'] * 100:+.0f}%)")
    for k, v in summary.items():
        print(f"{k}: {v}")
    write("tune_cpu", rows, summary, ["world", "pin", "measured_s", "before_s", "before_err", "after_s", "after_err",
                                      "peak_memory_gb"], "Predicted vs measured step time on CPU/gloo, before and after calibration",
          extra={"profiles": profiles})
    return 0


if __name__ == "__main__":
    sys.exit(main())
