"""Step time of autopar.compile against torchtitan's own ``parallelize_llama`` (TP, SP, FSDP,
AC and per-block ``torch.compile``, as torchtitan's trainer applies them; under PP its
``pipeline_llm`` with the 1F1B schedule and the same microbatches) on torchtitan's own
Llama 3 model, measured side by side in one run on CPU processes over gloo. autopar is handed the
same unparallelised model (a ``ModuleDict`` of blocks, fused QKV, complex RoPE: nothing of it is
autopar's). Steps alternate between the two (A B A B ...) after warm-up, so machine noise hits
both; the ratio is median(autopar) / median(torchtitan), the slowest rank's. The first step's
loss of both sides is compared (same weights, same data). The time to the end of the first step
(autopar's trace, plan, passes and compile, torchtitan's parallelize and its blocks' compile at
the first call, then the step) is measured for each side alone, in processes and caches of its
own: in one process, the side that runs second would find Inductor imported, its CPU probe done
and kernels built by the first; ``--first-repeats`` times each, the sides taking turns to go
first, the median reported (single runs of the same side differ by 10-20% on a 2-core machine). Also: one process, ``autopar.compile`` against torchtitan's
``apply_compile`` (each block compiled on its own); and each configuration's
memory per rank for one autopar step (``memory.allocator_peaks``: the allocator's peak above
what the process held before the step, without gloo's staging copies, which NCCL does not
allocate) against the planner's prediction of the same part (gradients, gathered parameters,
activations).

Needs ``make bench-deps`` (torchtitan 0.3.0). Targets (issue 9): ratio <= 1.0 on 4 processes
(aim 0.8), <= 1.05 on one.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import types

import torch
import torch.distributed as dist

from autopar import launch
from autopar.memory import allocator_peaks
from bench import torchtitan_side as tt
from bench.common import write

CONFIGS = [
    {"name": "fsdp4", "pins": {"dp": 4, "fsdp": 1, "pp": 1, "tp": 1, "ac": "none"}},
    {"name": "tp4_sp", "pins": {"tp": 4, "sp": 1, "pp": 1, "ac": "none"}},
    {"name": "fsdp2_tp2_sp", "pins": {"tp": 2, "sp": 1, "dp": 2, "fsdp": 1, "pp": 1, "ac": "none"}},
    {"name": "fsdp4_ac_full", "pins": {"dp": 4, "fsdp": 1, "pp": 1, "tp": 1, "ac": "full"}},
    # Under PP torchtitan keeps each stage's parameters gathered from the first microbatch's
    # forward to the step's end (``reshard_after_forward = not pp_enabled``; torch's pipeline
    # stage turns resharding after backward and the gradient reduction off but for the last
    # microbatch): one gather and one reduction a step, autopar's ``once=gather``.
    {"name": "pp2_fsdp2", "pins": {"pp": 2, "dp": 2, "fsdp": 1, "tp": 1, "ac": "none", "mb": 2, "schedule": "1f1b",
                                   "once": "gather"}},
]
BATCH = 8


def _data():
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, tt.VOCAB, (BATCH, tt.SEQ), generator=g),
            torch.randint(0, tt.VOCAB, (BATCH, tt.SEQ), generator=g))


def _measure(cfgs, steps, compile):
    """One rank's measurements (``launch.run`` made the process group and ends it)."""
    world = dist.get_world_size()
    import autopar
    from autopar.capture import default_loss

    out = []
    for cfg in cfgs:
        torch._dynamo.reset()  # each configuration compiles from scratch, as in its own job
        pins = cfg["pins"]
        base = tt.build_llama3(pins.get("tp", 1), bool(pins.get("sp")))
        ids, tgt = _data()
        # torchtitan's side is set up first: the other order makes its per-block compile of TP
        # blocks fail in Inductor (``device_mesh._get_submesh is not an OpOverload``) on torch 2.13
        pp = pins.get("pp", 1)
        if pp > 1:  # torchtitan's pipeline: its stages' parameters, its loss on the last stage's ranks
            titan = tt.pipeline(copy.deepcopy(base), pins, world, compile, BATCH, default_loss)
        else:
            titan = tt.parallelize(copy.deepcopy(base), pins, world, compile)
        pm = autopar.compile(copy.deepcopy(base), world, example_inputs=(ids,), plan=pins, compile=compile)
        fns = {"autopar": lambda: pm.step(ids, target=tgt),
               "torchtitan": (lambda: titan(ids, tgt)) if pp > 1 else
               (lambda: tt.train_step(titan, pm.plan, ids, tgt, pm._dp_rank, default_loss))}
        times, first = {"autopar": [], "torchtitan": []}, {}
        for i in range(2 + steps):
            for name in ("autopar", "torchtitan"):
                dist.barrier()
                t0 = time.perf_counter()
                loss = fns[name]()
                dist.barrier()
                if i == 0:  # same weights and data on both sides
                    first[name] = float(loss)
                if i >= 2:
                    times[name].append(time.perf_counter() - t0)
                if name == "torchtitan":  # its trainer zeroes the gradients every step (untimed)
                    for p in titan.parameters():
                        p.grad = None
        # torchtitan's loss is this rank's share of the batch: the mean over ranks is the global mean
        # (under PP over the last stage's ranks, the others add 0)
        titan_loss = torch.tensor(first["torchtitan"])
        dist.all_reduce(titan_loss)
        titan_loss *= pp
        for p in list(pm.parameters()) + list(titan.parameters()):
            p.grad = None
        mem = allocator_peaks(fns["autopar"])[1]
        r = {"name": cfg["name"], "plan": pm.plan.as_config_string(),
             "autopar_s": statistics.median(times["autopar"]), "torchtitan_s": statistics.median(times["torchtitan"]),
             "loss_diff": abs(first["autopar"] - float(titan_loss) / world),
             "measured_step_mib": mem, "predicted_step_mib": _predicted_mib(base, pm.plan, ids)}
        r["ratio"] = r["autopar_s"] / r["torchtitan_s"]
        out.append(r)
    return out


def _first_step(side: str, cfg: dict, compile: bool) -> float:
    """Seconds from the unparallelised model to the end of its first training step on this
    rank, for one side alone in processes of its own: nothing compiled, imported or probed by the
    other side before (``launch.run`` made the process group)."""
    import autopar
    from autopar.capture import default_loss

    world = dist.get_world_size()
    pins = cfg["pins"]
    base = tt.build_llama3(pins.get("tp", 1), bool(pins.get("sp")))
    ids, tgt = _data()
    dist.barrier()
    t0 = time.perf_counter()
    if side == "autopar":
        autopar.compile(base, world, example_inputs=(ids,), plan=pins, compile=compile).step(ids, target=tgt)
    elif pins.get("pp", 1) > 1:
        tt.pipeline(base, pins, world, compile, BATCH, default_loss)(ids, tgt)
    else:
        plan = types.SimpleNamespace(dp=world // pins.get("tp", 1), tp=pins.get("tp", 1))
        tt.train_step(tt.parallelize(base, pins, world, compile), plan, ids, tgt, dist.get_rank() // plan.tp,
                      default_loss)
    dist.barrier()
    return time.perf_counter() - t0


def _predicted_mib(model, plan, ids) -> float:
    """The planner's memory for this plan and model on its fullest rank (each pipeline rank with
    its own stage's layers), less what is resident before a step (parameters and AdamW state):
    fp32 gradients (4 of the 16 bytes it counts per parameter), gathered parameters and
    activations."""
    from autopar import api, search
    from autopar.cost_models.hardware import load
    from autopar.cost_models.step import Config, CostContext, StageModel

    prof = api.profile_model(model, example_inputs=(ids[:1],), precision="fp32")
    hw = load({**load("cpu-gloo").to_dict(), "reserve_gb": 0.0})
    ctx = CostContext(prof.profile, hw, plan.global_batch, "fp32")
    cfg = Config(tp=plan.tp, pp=plan.pp, dp=plan.dp, dp_shard=plan.dp_shard, sp=plan.sp, fsdp=plan.fsdp,
                 reshard=plan.reshard_after_forward, mb=plan.mb, schedule=plan.schedule if plan.pp > 1 else "1f1b",
                 v=plan.v, fsdp_once=plan.fsdp_once if plan.fsdp else "")
    sm = StageModel(ctx, cfg)
    out = 0.0
    for r in range(plan.pp):
        counts = tuple(sum(1 for lp in plan.layers if lp.stage == r and lp.ac == a) for a in search.AC_MODES)
        mem = sm.rank_memory(r, counts)
        out = max(out, mem["parameters+grads+optimizer"] / 4 + mem["unsharded_params"] + mem["activations"])
    return out / 2**20


def single_process(steps: int) -> dict:
    """One process: autopar.compile (a 1-GPU plan) against torchtitan's compile (each block on its
    own, its ``apply_compile``) of the same model, the whole batch in one pass on both sides."""
    from torchtitan.config import CompileConfig
    from torchtitan.distributed.compile import apply_compile

    import autopar
    from autopar.capture import default_loss

    base = tt.build_llama3()
    ids, tgt = _data()
    pm = autopar.compile(copy.deepcopy(base), 1, example_inputs=(ids,), plan={"ac": "none", "mb": BATCH})
    ref = copy.deepcopy(base)
    apply_compile(ref, compile_config=CompileConfig(enable=True, components=["model"]),
                  parallel_dims=types.SimpleNamespace(tp_enabled=False))
    times = {"autopar": [], "torchtitan": []}
    fns = {"autopar": lambda: pm.step(ids, target=tgt),
           "torchtitan": lambda: tt.train_step(ref, pm.plan, ids, tgt, 0, default_loss)}
    for i in range(2 + steps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            if i >= 2:
                times[name].append(time.perf_counter() - t0)
    a, b = statistics.median(times["autopar"]), statistics.median(times["torchtitan"])
    return {"name": "single_process", "plan": pm.plan.as_config_string(),
            "autopar_s": a, "torchtitan_s": b, "ratio": a / b}


def _fresh_caches(probed: bool = False) -> None:
    """One fresh Inductor cache, shared by the ranks launched next: a graph cached by an earlier
    launch names process groups by their number in that launch, which can be another group in
    this one (torchtitan's TP blocks compiled under TP 4 then ran under TP 2 x FSDP 2 and hung). A fresh autopar cache
    too: the time to the first step is a first run's (no step graphs stored by an earlier one,
    passes/shared.py)."""
    import tempfile

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="autopar-inductor-")
    os.environ["AUTOPAR_CACHE_DIR"] = tempfile.mkdtemp(prefix="autopar-cache-")
    if probed:  # Inductor's own probe builds its test library of every instruction set in the cache
        import subprocess

        subprocess.run([sys.executable, "-c", "from torch._inductor import cpu_vec_isa; cpu_vec_isa.pick_vec_isa()"],
                       check=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--only", default="", help="comma-separated configuration names (default: all)")
    ap.add_argument("--no-single", action="store_true", help="skip the one-process comparison")
    ap.add_argument("--first-repeats", type=int, default=3,
                    help="times to the first step measured per side, turn about (the median is reported)")
    ap.add_argument("--probed", action="store_true",
                    help="the times to the first step with Inductor's CPU instruction-set test libraries already "
                         "built in the fresh caches (each side still loads them: Inductor's probe, autopar's): "
                         "without the one-time builds a GPU run does not make")
    args = ap.parse_args(argv)
    compile = not args.no_compile
    why = tt.available()
    if why:
        print(why, file=sys.stderr)
        return 2
    torch.set_num_threads(2)
    _fresh_caches()
    cfgs = [c for c in CONFIGS if not args.only or c["name"] in args.only.split(",")]
    rows = [] if args.no_single else [single_process(args.steps)]
    for cfg in cfgs:  # each configuration in its own processes, as each would be its own job
        _fresh_caches()
        per = [x[0] for x in launch.run(4, "gloo", _measure, [cfg], args.steps, compile, timeout=1200)]
        row = dict(per[0])
        firsts = {"autopar": [], "torchtitan": []}
        for i in range(args.first_repeats):  # each side alone, in fresh processes and caches, turn about
            for side in (("autopar", "torchtitan") if i % 2 == 0 else ("torchtitan", "autopar")):
                _fresh_caches(args.probed)
                firsts[side].append(max(launch.run(4, "gloo", _first_step, side, cfg, compile, timeout=900)))
        for side, ts in firsts.items():
            row[f"{side}_first_s"] = statistics.median(ts)
            row[f"{side}_first_runs"] = [round(t, 1) for t in ts]
        row["first_ratio"] = row["autopar_first_s"] / row["torchtitan_first_s"]
        row["autopar_s"] = max(x["autopar_s"] for x in per)
        row["torchtitan_s"] = max(x["torchtitan_s"] for x in per)
        row["ratio"] = row["autopar_s"] / row["torchtitan_s"]
        row["measured_step_mib"] = max(x["measured_step_mib"] for x in per)
        rows.append(row)
    for r in rows:
        print(f"{r['name']:16s} {r['plan'][:60]:60s} autopar {r['autopar_s']:.3f}s torchtitan {r['torchtitan_s']:.3f}s "
              f"ratio {r['ratio']:.3f}" + (f"  first step {r['autopar_first_s']:.1f} s vs {r['torchtitan_first_s']:.1f} s"
                                          if "first_ratio" in r else "") + (f"  step memory {r['measured_step_mib']:.0f} MiB (predicted {r['predicted_step_mib']:.0f})"
                                          if "measured_step_mib" in r else ""))
    multi = [r for r in rows if r["name"] != "single_process"]
    summary = {"compiled": compile, "steps timed": args.steps, "model": "torchtitan Llama3Model at llama-small shapes",
               "batch": f"{BATCH} x {tt.SEQ}", "torchtitan": "0.3.0 parallelize_llama",
               "max first-step loss difference": f"{max(r['loss_diff'] for r in multi):.2e}",
               "max ratio (4 processes)": f"{max(r['ratio'] for r in multi):.3f} (target <= 1.0)",
               "max time to the first step, autopar / torchtitan (4 processes)":
                   f"{max(r['first_ratio'] for r in multi):.3f} (target <= 1.0)",
               **next(({"single-process ratio": f"{r['ratio']:.3f} (target <= 1.05)"} for r in rows
                       if r["name"] == "single_process"), {})}
    if args.probed:
        summary["CPU probe"] = "Inductor's instruction-set test libraries built before each first step (--probed)"
    partial = bool(args.only) or args.no_single  # a subset never replaces the full table
    write("step_ratio_probed" if args.probed else "step_ratio_partial" if partial else "step_ratio", rows, summary,
          ["name", "plan", "autopar_s", "torchtitan_s", "ratio", "autopar_first_s", "torchtitan_first_s", "first_ratio",
           "autopar_first_runs", "torchtitan_first_runs", "loss_diff",
           "measured_step_mib", "predicted_step_mib"],
          "autopar.compile vs torchtitan's own parallelize_llama, step time, CPU gloo")
    return 0



if __name__ == "__main__":
    sys.exit(main())
