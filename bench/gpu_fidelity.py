"""On one GPU: is what runs what the cost model priced? Stages, each its own process (one
that fails or hangs leaves the others' results), written to bench/results/gpu_fidelity.{json,md}:

- ``calibrate``: the microbenchmarks ``autopar tune calibrate`` fits a profile from (bf16 matmul,
  causal attention, HBM bandwidth by size, a tiny op's launch), beside the ``h100`` profile's figures.
- ``single``: one GPU, bf16-mixed (fp32 masters, bf16 compute), a Llama of hidden 2048: ``autopar.compile``
  against ``torch.compile`` of the whole model under ``torch.autocast`` (what a user writes for one
  GPU), the same model and batch in the same process: time to the first step, step time (median),
  the allocator's peak over a step; and the planner's predicted step time and memory for it.
- ``rank``, ``rank_tp``, ``rank_flat``: one rank of Llama-3-8B (real width, vocabulary and
  8,192-token sequences, 4 layers) under FSDP over 64 GPUs (``rank_tp``: TP 8 + SP x FSDP 8;
  ``rank_flat``: every layer inline), bf16-mixed, on PyTorch's fake process group (collectives
  allocate their outputs and move nothing: the rank's memory and compute are real, its
  communication is not):
  the allocator's peak of one step against the liveness walk of the graphs that ran and the cost
  model's prediction, and the step's compute time against the predicted compute time.

``python -m bench.gpu_fidelity [--small]`` (``--small``: shapes that run on a CPU, to check the
script)."""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time

import torch

OUT = os.environ.get("OUT") or os.path.join(os.path.dirname(__file__), "results")


def _device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        _sync()
        t = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def stage_calibrate(small: bool) -> dict:
    from autopar import tune
    from autopar.cost_models.hardware import load as load_hardware

    cal = tune.calibrate("h100", reps=3 if small else 10)
    path = os.path.join(OUT, "gpu_calibrated_profile.json")
    with open(path, "w") as f:
        json.dump(cal.profile, f, indent=1)
    h100 = load_hardware("h100")
    return {"points": {k: cal.points[k] for k in ("matmul", "attention", "memory", "memory_by_size")},
            "fitted_efficiency": cal.profile["efficiency"], "fitted_bandwidth_gbps": cal.profile["memory_bandwidth_gbps"],
            "h100_profile": {"peak_tflops": h100.peak_tflops, "efficiency": h100.efficiency,
                             "memory_bandwidth_gbps": h100.memory_bandwidth_gbps}}


def _zero(params):
    for p in params:
        p.grad = None


def stage_single(small: bool) -> dict:
    import autopar
    from autopar import models

    dev = _device()
    cfg = models._llama(128, 2, 4, 2, 256, vocab=512, seq=64) if small else models._llama(2048, 8, 16, 8, 5632, vocab=32000, seq=2048)
    batch = 2 if small else 4
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (batch, cfg.max_seq_len), generator=g).to(dev)
    tgt = torch.roll(ids, -1, dims=1)
    out: dict = {"model": f"Llama hidden {cfg.dim}, {cfg.n_layers} layers, vocab {cfg.vocab_size}",
                 "batch": [batch, cfg.max_seq_len]}

    torch.manual_seed(0)
    model = models.Llama(cfg).to(dev)
    t0 = time.perf_counter()
    pm = autopar.compile(model, 1, example_inputs=(ids,), mp_policy="bf16-mixed", hardware="h100", global_batch=batch)
    setup = time.perf_counter() - t0
    out["autopar"] = _measure(pm.step, (ids,), {"target": tgt}, list(pm.parameters()), t0, small)
    pred = pm.plan.predicted
    out["autopar"].update(plan=pm.plan.as_config_string(), setup_s=setup, predicted_step_s=pred["step_time_s"],
                          predicted_compute_s=pred["breakdown"]["compute"] + pred["breakdown"]["recompute"],
                          predicted_step_memory_mib=(pred["memory_breakdown_gb"]["unsharded_params"]
                                                     + pred["memory_breakdown_gb"]["activations"]) * 1024)
    del pm, model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    torch.manual_seed(0)
    ref = models.Llama(cfg).to(dev)
    cm = torch.compile(ref)

    out["torch_compile_autocast"] = _measure(_autocast_step(cm, ids, tgt), (), {}, list(ref.parameters()), time.perf_counter(), small)
    out["ratios"] = {k: out["autopar"][k] / out["torch_compile_autocast"][k]
                     for k in ("first_step_s", "step_s", "peak_mib")}
    return out


def _autocast_step(model, ids, tgt):
    """What a user writes for one GPU in bf16: the forward under ``torch.autocast``, the loss in fp32."""
    def step():
        with torch.autocast(ids.device.type, dtype=torch.bfloat16):
            logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, -2).float(), tgt.flatten())
        loss.backward()
        return loss
    return step


def _measure(fn, args: tuple, kwargs: dict, params, t0: float, small: bool) -> dict:
    """Time to the end of the first step (from ``t0``), the allocator's peak over a step that
    starts without gradients, and the median step time (gradients dropped before each)."""
    from autopar import memory

    def step():
        return fn(*args, **kwargs)

    step()
    _sync()
    first = time.perf_counter() - t0
    _zero(params)
    peak = memory.allocator_peaks(step)[0]
    t = _timed(lambda: (_zero(params), step()), 3 if small else 10)
    return {"first_step_s": first, "step_s": t, "peak_mib": peak}


def stage_rank(small: bool, tp: int = 1, regions: bool = True) -> dict:
    """One rank of a 64-rank plan on the fake process group: FSDP 64, or (``tp`` > 1) TP + SP
    within ``tp`` ranks x FSDP over the rest (each TP rank reads its coordinate at run time:
    ``passes/coords.py``)."""
    import dataclasses

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import autopar
    from autopar import memory, models

    world = 4 if small else 64
    base = models.PRESETS["llama-small" if small else "llama3-8b"]
    cfg = dataclasses.replace(base, n_layers=2 if small else 4, max_seq_len=64 if small else base.max_seq_len)
    dev = _device()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    tp = min(tp, 2) if small else tp
    dp = world // tp
    with torch.device("meta"):
        model = models.Llama(cfg)
    model = model.to_empty(device=dev)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    ids = torch.randint(0, cfg.vocab_size, (dp, cfg.max_seq_len), generator=torch.Generator().manual_seed(0)).to(dev)
    plan = {"dp": dp, "fsdp": 1, "pp": 1, "tp": tp, "sp": int(tp > 1), "ac": "none", "mb": 1}
    mesh = init_device_mesh(dev.type, (dp, tp) if tp > 1 else (dp,), mesh_dim_names=("dp", "tp") if tp > 1 else ("dp",))
    t0 = time.perf_counter()
    pm = autopar.compile(model, mesh, example_inputs=(ids,), plan=plan, mp_policy="bf16-mixed", hardware="h100",
                         global_batch=dp, disable_passes=() if regions else ("regions",))
    t1 = time.perf_counter()
    pm.step(ids, target=ids)
    _sync()
    t2 = time.perf_counter()
    params = list(pm.parameters())
    _zero(params)
    alloc = memory.allocator_peaks(lambda: pm.step(ids, target=ids))[0]
    step = _timed(lambda: (_zero(params), pm.step(ids, target=ids)), 3 if small else 5)
    walk = memory.step_peak(pm).peak_bytes / 2**20
    walk_nograd = memory.step_peak(pm, gradients=False).peak_bytes / 2**20
    pred = pm.plan.predicted
    mb = pred["memory_breakdown_gb"]
    held = sum(int(getattr(q, "_local_tensor", q).nbytes) for q in params) / 2**20
    out = {"model": f"Llama-3-8B width, {cfg.n_layers} layers, seq {cfg.max_seq_len}", "world": world,
           "plan": pm.plan.as_config_string(), "precision": pm.plan.precision, "setup_s": t1 - t0,
           "first_step_s": t2 - t0, "step_s": step, "allocator_step_peak_mib": alloc,
           "walk_step_peak_mib": walk, "walk_step_peak_without_grad_shards_mib": walk_nograd,
           "param_shards_mib": held, "predicted_step_memory_mib": (mb["unsharded_params"] + mb["activations"]) * 1024,
           "predicted_breakdown_gb": mb, "predicted_compute_s": pred["breakdown"]["compute"],
           "predicted_step_s": pred["step_time_s"]}
    compiled = pm._step_runner.compiled
    # the places a TP rank reads its coordinate at run time instead of a constant of rank 0's
    out["run_time_rank_reads"] = sum(g.code.count("autopar.group_rank") for g in (compiled.fw_graph, compiled.bw_graph))
    out["allocator_over_walk"] = alloc / walk
    out["allocator_over_predicted"] = alloc / out["predicted_step_memory_mib"]
    out["step_over_predicted_compute"] = step / out["predicted_compute_s"]
    dist.destroy_process_group()
    return out


def stage_startup(how: str, layers: int, small: bool) -> dict:
    """Time to the end of the first step on one GPU, bf16-mixed, in a fresh process with an empty
    Inductor cache: ``autopar`` as it is by default (each distinct layer compiled once), ``flat``
    (``disable_passes=("regions",)``: every layer compiled inline), ``block`` (``torch.compile`` on
    each decoder block under ``torch.autocast``, torchtitan's way). Then the median step time."""
    import tempfile

    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="autopar-inductor-")
    os.environ["AUTOPAR_QUIET"] = "1"
    import autopar
    from autopar import models

    dev = _device()
    cfg = models._llama(128, layers, 4, 2, 256, vocab=512, seq=64) if small else models._llama(
        2048, layers, 16, 8, 5632, vocab=32000, seq=2048)
    batch = 2 if small else 4
    ids = torch.randint(0, cfg.vocab_size, (batch, cfg.max_seq_len), generator=torch.Generator().manual_seed(0)).to(dev)
    tgt = torch.roll(ids, -1, dims=1)
    torch.manual_seed(0)
    model = models.Llama(cfg).to(dev)
    t0 = time.perf_counter()
    if how == "block":
        for layer in model.layers:
            layer.compile()
        step = _autocast_step(model, ids, tgt)
        params = list(model.parameters())
    else:
        pm = autopar.compile(model, 1, example_inputs=(ids,), plan=f"mb={batch}", mp_policy="bf16-mixed", hardware="h100",
                             global_batch=batch, disable_passes=("regions",) if how == "flat" else ())
        step = functools.partial(pm.step, ids, target=tgt)
        params = list(pm.parameters())
    loss = float(step())
    _sync()
    first = time.perf_counter() - t0
    t = _timed(lambda: (_zero(params), step()), 3 if small else 10)
    out = {"how": how, "layers": layers, "model": f"Llama hidden {cfg.dim}, vocab {cfg.vocab_size}, batch {batch} x "
           f"{cfg.max_seq_len}", "first_step_s": first, "step_s": t, "loss": loss}
    if how != "block":
        out["regions"] = pm.info.notes.get("regions")
        out["timings"] = {k: round(v, 2) for k, v in pm.info.timings.items()}
    return out


STAGES = {"calibrate": stage_calibrate, "single": stage_single, "rank": stage_rank,
          "rank_tp": functools.partial(stage_rank, tp=8), "rank_flat": functools.partial(stage_rank, regions=False)}
STAGES.update({f"start_{how}_{n}": functools.partial(stage_startup, how, n)
               for n in (8, 32) for how in ("autopar", "block", "flat")})


def _device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--stage", choices=sorted(STAGES))
    ap.add_argument("--timeout", type=float, default=240)
    ap.add_argument("--only", default=",".join(STAGES))
    a = ap.parse_args(argv)
    if a.stage:  # one stage, in this process: its result as the last line
        try:
            print("RESULT " + json.dumps(STAGES[a.stage](a.small), default=str), flush=True)
        except Exception:
            import traceback

            with open(os.path.join(OUT, f"gpu_fidelity_{a.stage}_error.txt"), "w") as f:
                traceback.print_exc(file=f)
            raise
        return 0
    os.makedirs(OUT, exist_ok=True)
    results = {"device": _device_name(), "torch": torch.__version__}
    for name in a.only.split(","):
        t = time.perf_counter()
        cmd = [sys.executable, "-m", "bench.gpu_fidelity", "--stage", name] + (["--small"] if a.small else [])
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout,
                               env=dict(os.environ, PYTHONFAULTHANDLER="1"))
            lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            results[name] = json.loads(lines[-1][7:]) if lines else {
                "error": f"exit status {p.returncode}: " + p.stderr[-3000:], "stdout": p.stdout[-1000:]}
        except subprocess.TimeoutExpired as e:
            results[name] = {"error": f"timed out after {a.timeout} s", "stderr": (e.stderr or b"")[-2000:].decode(errors="replace")}
        results[name]["stage_wall_s"] = time.perf_counter() - t
        print(name, json.dumps(results[name], indent=1, default=str), flush=True)
        with open(os.path.join(OUT, "gpu_fidelity.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
