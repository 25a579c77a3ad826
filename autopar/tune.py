"""Benchmark-driven tuning: measure the machine, fit the cost model to it, measure candidate plans.

Calibration (``autopar tune calibrate``), called by every local rank together:

- compute, one rank's worth at a time where ranks share cores (``_in_turns``; the cost model
  shares the cores out itself with the profile's ``compute_slots``): matmul throughput (fp32 on
  CPU, bf16 on GPUs) over a few shapes, causal fused attention, element-wise bandwidth by size
  with outputs kept alive as activations are, in-place bandwidth (the optimizer's), one tiny op;
- the eager runtime's own time: DTensor dispatch per TP linear and per op on sequence shards,
  and the pipeline schedule per microbatch and stage;
- all-reduce, all-gather, reduce-scatter, all-to-all and send/recv over every power-of-two group
  size up to N (groups tiling the ranks, all running at once) and messages from 1 KiB up, each
  fitted to ``t = alpha + bytes / beta`` by least squares of the relative error; the cost model
  uses these instead of its analytic ring model.

With ``--model`` (``calibrate_model``), the matmul, attention and memory-bound efficiencies are
then fitted to the model's own operators, and the node's effective compute slots are measured
(the model's step on every rank at once against one rank alone).

Plan tuning (``autopar tune plans``, ``autopar.compile(..., tune=True)``): the planner's top K
plans run a few real steps each (warm-up excluded); the fastest measured one that fits in memory
wins. Measurements are kept in SQLite keyed by model fingerprint, mesh, hardware, torch version and
plan, so a second run reuses them and says so.
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from autopar.cost_models.hardware import Hardware
from autopar.cost_models.hardware import load as load_hardware
from autopar.runtime import rank_device

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


def _once(fn: Callable, sync: Callable, group) -> float:
    """Seconds of one call of ``fn``, started with the ranks in step."""
    if dist.is_initialized():
        dist.barrier(group=group)
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def _timeit(fn: Callable, reps: int, sync: Callable = lambda: None, group=None) -> float:
    """Median seconds of ``fn`` over ``reps`` runs after one warm-up, ranks in step."""
    fn()
    sync()
    return statistics.median(_once(fn, sync, group) for _ in range(reps))


def _paired_difference(fa: Callable, fb: Callable, reps: int, sync: Callable = lambda: None, group=None) -> float:
    """Median over ``reps`` pairs of (seconds of ``fa`` - seconds of ``fb``), the two run back to
    back in each pair, so that load from elsewhere on the machine hits both alike."""
    for f in (fa, fb):  # warm-up
        f()
        sync()
    return statistics.median(_once(fa, sync, group) - _once(fb, sync, group) for _ in range(reps))


def _sustained(fn: Callable, reps: int, sync: Callable, seconds: float = 0.2, group=None) -> float:
    """Seconds per call of ``fn`` over runs of at least ``seconds`` (steadier than single calls;
    ranks that run at once contend as they do in training rather than taking turns)."""
    probe = _timeit(fn, 1, sync, group)
    n = max(1, int(seconds / max(probe, 1e-6)))

    def many():
        for _ in range(n):
            fn()

    return _timeit(many, reps, sync, group) / n


def compute_slots(world: int, cuda: bool) -> int:
    """How many of this host's ranks can compute at once: one per GPU; on CPUs, cores divided by
    each process's threads."""
    if cuda:
        return world
    return max(1, min(world, (os.cpu_count() or 1) // max(1, torch.get_num_threads())))


def _in_turns(slots: int, fn: Callable):
    """``fn(group)`` on every rank, at most ``slots`` ranks at a time, so that what it measures is
    one rank's own speed (the cost model shares the slots out itself). ``group`` holds the ranks of
    the turn (None: all ranks at once). A fractional ``slots`` (a measured one) rounds down."""
    slots = max(1, int(slots))
    if not dist.is_initialized() or slots >= dist.get_world_size():
        return fn(None)
    world, rank = dist.get_world_size(), dist.get_rank()
    turns = [list(range(s, min(world, s + slots))) for s in range(0, world, slots)]
    groups = [dist.new_group(t) for t in turns]  # collective: every rank creates every group
    out = None
    for members, group in zip(turns, groups):
        if rank in members:
            out = fn(group)
        dist.barrier()
    return out


def _dtensor_overhead(group, device, sync, reps: int) -> tuple[float, float]:
    """Eager DTensor dispatch time (seconds, forward + backward) per tensor-parallel linear and per
    op on a sequence-sharded DTensor (what sequence-parallel norms run): tiny tensors, so what is
    left after the local compute and the collectives is the framework's own time."""
    import torch.nn as nn
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = DeviceMesh.from_group(group or dist.group.WORLD, device.type)
    g = mesh.size()
    width = 16 * g
    torch.manual_seed(0)
    mlp = lambda: nn.Sequential(nn.Linear(width, width, bias=False), nn.ReLU(), nn.Linear(width, width, bias=False)).to(device)  # noqa: E731
    ref, tp = mlp(), mlp()
    parallelize_module(tp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x = torch.randn(2, 8, width, device=device, requires_grad=True)
    y = torch.ones(2 * 8 * width, device=device)

    def fwd_bwd(m):
        return lambda: m(x).sum().backward()

    n = 4 * reps

    def plain_and_reduces():  # what TP adds to the plain MLP: the row's reduce (forward), the column input's (backward)
        fwd_bwd(ref)()
        dist.all_reduce(y, group=group)
        dist.all_reduce(y, group=group)

    per_linear = max(0.0, _paired_difference(fwd_bwd(tp), plain_and_reduces, n, sync, group) / 2)
    # A norm-like chain (mul, mean, add: 12 ops) on a sequence-sharded DTensor against plain tensors.
    def chain(y):
        for _ in range(4):
            y = (y * y).mean(-1, keepdim=True) + y
        return y

    xs = DTensor.from_local(x.detach(), mesh, [Shard(1)], run_check=False).requires_grad_()
    xl = x.detach().requires_grad_()
    sp = _paired_difference(lambda: chain(xs).to_local().sum().backward(), lambda: chain(xl).sum().backward(),
                            n, sync, group)
    return per_linear, max(0.0, sp) / 12


def fit_alpha_beta(sizes: list[float], times: list[float]) -> tuple[float, float]:
    """Least squares of the relative error of ``t = alpha + n / beta`` (each point weighted by
    ``1/t``, so microsecond latencies count as much as long transfers): (alpha us, beta GB/s)."""
    t = np.asarray(times, dtype=np.float64)
    A = np.stack([np.ones(len(sizes)), np.asarray(sizes, dtype=np.float64)], axis=1) / t[:, None]
    (alpha, inv_beta), *_ = np.linalg.lstsq(A, np.ones(len(t)), rcond=None)
    alpha = max(float(alpha), 0.0)
    inv_beta = max(float(inv_beta), 1e-15)
    return alpha * 1e6, 1.0 / inv_beta / 1e9


def _collective(kind: str, nbytes: int, group, gsize: int, device, rank_in_group: int) -> Callable:
    n = max(1, nbytes // 4)
    n -= n % gsize
    n = max(n, gsize)
    x = torch.ones(n, dtype=torch.float32, device=device)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(x, group=group)
    if kind == "all_gather":
        shard = torch.ones(n // gsize, device=device)
        return lambda: dist.all_gather_into_tensor(x, shard, group=group)
    if kind == "reduce_scatter":
        out = torch.empty(n // gsize, device=device)
        return lambda: dist.reduce_scatter_tensor(out, x, group=group)
    if kind == "all_to_all":
        out = torch.empty_like(x)
        return lambda: dist.all_to_all_single(out, x, group=group)
    if kind == "send_recv":
        peer = dist.get_global_rank(group, 1 - rank_in_group) if rank_in_group < 2 else None

        def fn():
            if rank_in_group == 0:
                dist.send(x, dst=peer)
                dist.recv(x, src=peer)
            elif rank_in_group == 1:
                dist.recv(x, src=peer)
                dist.send(x, dst=peer)

        return fn
    raise ValueError(kind)


@dataclass
class Calibration:
    profile: dict
    points: dict  # raw measurements, for the plot


def _compute_benchmarks(cuda: bool, device, dtype, sync, reps: int, group) -> dict:
    """Matmul (best of a few shapes), causal attention, element-wise bandwidth by size (a curve:
    small kernels on GPUs, fresh activation memory on CPUs), in-place
    bandwidth of the largest buffer (the optimizer's) and the cost of one tiny op."""
    out: dict = {"matmul": []}
    shapes = [(2048, 2048, 2048), (4096, 1024, 4096), (8192, 8192, 8192)] if cuda else [(256, 256, 256), (512, 512, 512), (1024, 512, 1024)]
    best = 0.0
    for m, k, n in shapes:
        a, b = torch.randn(m, k, dtype=dtype, device=device), torch.randn(k, n, dtype=dtype, device=device)
        rate = 2 * m * k * n / _sustained(lambda: a @ b, reps, sync, group=group)
        out["matmul"].append({"shape": [m, k, n], "tflops": rate / 1e12})
        best = max(best, rate)
    out["best"] = best
    b_, h_, s_, d_ = (4, 16, 2048, 128) if cuda else (2, 4, 256, 32)
    q = torch.randn(b_, h_, s_, d_, dtype=dtype, device=device)
    t = _sustained(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True), reps, sync, group=group)
    out["attention"] = 4 * b_ * h_ * s_ * s_ * d_ * 0.5 / t
    curve = []
    for mb in ((0.25, 1, 4, 16, 64, 256, 1024) if cuda else (0.25, 0.5, 1, 2, 4, 8, 16, 32, 64)):
        x = torch.ones(int(mb * (1 << 20)) // 4, device=device)
        kept: list = []

        def op():
            # Outputs stay alive up to a budget, as a forward pass keeps its activations: fresh
            # memory each time (page faults on CPUs, which return freed memory to the system).
            kept.append(x.add(1.0))
            if len(kept) * mb >= max(256, 4 * mb):
                kept.clear()

        t = _sustained(op, reps, sync, group=group)
        kept.clear()
        curve.append([2 * x.numel() * 4, 2 * x.numel() * 4 / t / 1e9])  # bytes moved, GB/s
    out["curve"] = curve
    big = torch.ones(int(curve[-1][0]) // 8, device=device)
    out["bw"] = 2 * big.numel() * 4 / _sustained(lambda: big.add_(1.0), reps, sync, group=group)
    small = torch.ones(8, device=device)
    out["op_s"] = _sustained(lambda: small.add(1.0), reps, sync, group=group)
    return out


def _pipeline_overhead(group, device, sync, reps: int) -> float:
    """Seconds per microbatch and stage that the pipeline schedule itself takes (forward and
    backward actions, P2P latency excluded): a GPipe step of tiny stages over the group's ranks
    fills ``M + stages - 1`` slots; what a slot takes beyond two tiny transfers is the runtime's."""
    import torch.nn as nn
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    pg = group or dist.group.WORLD
    g, r = dist.get_world_size(pg), dist.get_rank(pg)
    if g < 2:
        return 0.0
    M = 4
    torch.manual_seed(0)
    stage = PipelineStage(nn.Linear(16, 16).to(device), r, g, device, group=pg)
    sched = ScheduleGPipe(stage, n_microbatches=M, loss_fn=lambda out, tgt: (out - tgt).pow(2).sum())
    x = torch.randn(2 * M, 16, device=device)

    def step():
        sched.step(*((x,) if r == 0 else ()), **({"target": x} if r == g - 1 else {}))

    t = _timeit(step, 4 * reps, sync, pg)
    y = torch.ones(2 * 16, device=device)
    p2p = _timeit(_collective("send_recv", y.numel() * 4, pg, g, device, r), 4 * reps, sync, pg)
    return max(0.0, t / (M + g - 1) - p2p)  # one send/recv round trip: a forward and a backward transfer


def _median_over_ranks(measured: dict) -> dict:
    """The median across ranks of every number in ``measured`` (same structure on every rank)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return measured
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, measured)

    def med(values):
        first = values[0]
        if isinstance(first, dict):
            return {k: med([v[k] for v in values]) for k in first}
        if isinstance(first, (list, tuple)):
            return [med([v[i] for v in values]) for i in range(len(first))]
        if isinstance(first, (int, float)):
            return statistics.median(values)
        return first

    return med(everyone)


def calibrate(base: str | Hardware, *, max_bytes: int | None = None, reps: int = 5,
              progress: Callable[[str, int, int], None] | None = None) -> Calibration:
    """Run every microbenchmark on this rank (all ranks call it together) and fit a profile."""
    hw = load_hardware(base)
    cuda = torch.cuda.is_available() and (not dist.is_initialized() or dist.get_backend() == "nccl")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    max_bytes = max_bytes or ((256 << 20) if cuda else (16 << 20))
    dtype = torch.bfloat16 if cuda else torch.float32
    points: dict = {"collectives": {}}
    steps = [0]
    sizes = [1 << k for k in range(10, int(math.log2(max_bytes)) + 1, 2)]
    groups = [g for g in (2 ** i for i in range(1, 16)) if g <= world]
    total = 2 + ((len(COLLECTIVES) - 1) * len(groups) + 1) * len(sizes)

    def tick(what: str):
        steps[0] += 1
        if progress and rank == 0:
            progress(what, steps[0], total)

    slots = compute_slots(world, cuda)
    measured = _in_turns(slots, lambda group: _compute_benchmarks(cuda, device, dtype, sync, reps, group))
    measured = _median_over_ranks(measured)  # one profile for every rank
    if not cuda:
        # Fresh activation memory on a CPU is page-fault bound at every size; what varies between
        # sizes is run-to-run noise, so one level (the median) is kept (the model fit scales it).
        level = statistics.median(b for _, b in measured["curve"])
        measured["curve"] = [[measured["curve"][0][0], level]]
    best, attn_rate, curve, bw, t_small = (measured[k] for k in ("best", "attention", "curve", "bw", "op_s"))
    points.update(matmul=measured["matmul"], memory_by_size=curve,
                  attention=[{"tflops": attn_rate / 1e12}], memory=[{"gbps": bw / 1e9, "op_us": t_small * 1e6}])
    tick("compute")
    tp_linear = sp_op = 0.0
    if world > 1:
        tp_linear, sp_op = _in_turns(slots, lambda group: _dtensor_overhead(group, device, sync, reps))
    points["dtensor_overhead_us"] = {"tp_linear": tp_linear * 1e6, "sp_op": sp_op * 1e6}
    pp_mb = _in_turns(slots, lambda group: _pipeline_overhead(group, device, sync, reps)) if world > 1 else 0.0
    points["pipeline_overhead_us"] = pp_mb * 1e6
    tick("framework overheads")

    fitted: dict = {}
    # Groups of g ranks tile the ranks and all run at once, as TP or FSDP groups do in training
    # (they share links, NICs or cores). Every rank creates every group, in the same order.
    group_of = {}
    for g in groups:
        for start in range(0, world - world % g, g):
            pg = dist.new_group(list(range(start, start + g))) if dist.is_initialized() else None
            if start <= rank < start + g:
                group_of[g] = (pg, start)
    for kind in COLLECTIVES:
        for g in groups:
            if kind == "send_recv" and g > 2:
                continue  # point-to-point is between two ranks
            group, start = group_of.get(g, (None, None))
            ts = []
            for nbytes in sizes:
                if start is not None:
                    fn = _collective(kind, nbytes, group, g, device, rank - start)
                    tt = _timeit(fn, reps, sync, group=group)
                else:
                    tt = None
                ts.append(tt)
                tick(f"{kind} over {g}")
            # A send/recv round trip moves the message twice; the cost model prices one way.
            mine = [(n, t / 2 if kind == "send_recv" else t) for n, t in zip(sizes, ts) if t is not None]
            gathered = [None] * world
            if dist.is_initialized():
                dist.all_gather_object(gathered, mine)
            else:
                gathered = [mine]
            r0 = gathered[0]
            if r0:
                alpha, beta = fit_alpha_beta([n for n, _ in r0], [t for _, t in r0])
                fitted.setdefault(kind, {})[str(g)] = [alpha, beta]
                points["collectives"].setdefault(kind, {})[str(g)] = r0

    peak = hw.peak_tflops * 1e12
    if best > peak:  # no data-sheet peak (a CPU): the best measurement is the peak
        peak = best
    prof = hw.to_dict()
    prof.update(
        name=f"{hw.name}-calibrated", peak_tflops=peak / 1e12, memory_bandwidth_gbps=bw / 1e9,
        gpus_per_node=max(world, 1), collectives=fitted, launch_us=t_small * 1e6,
        compute_slots=slots if slots < world else 0, tp_linear_us=tp_linear * 1e6, sp_op_us=sp_op * 1e6,
        pp_microbatch_us=pp_mb * 1e6,
        bandwidth_curve=curve,
        efficiency={**hw.efficiency, "matmul": min(1.0, best / peak), "attention": min(1.0, attn_rate / peak), "memory": 1.0},
        note=f"calibrated by autopar tune on {world} {'GPU' if cuda else 'CPU'} processes, torch {torch.__version__}",
    )
    return Calibration(prof, points)


def calibrate_model(profile: dict | str | Hardware, model_factory: Callable, example_inputs: tuple, *,
                    loss_fn: Callable | None = None, reps: int = 3) -> Calibration:
    """Fit the compute efficiencies to the model's own operators (all ranks call it together; each
    runs the whole model on its own, in turns where ranks share cores, and the node's effective
    compute slots are measured by running it on every rank at once).

    One forward and backward of the real model is timed (wall clock) and profiled; the profiler's
    split of the time into matmuls, attention kernels and everything else, set against the cost
    model's pricing of the same traced nodes, gives each kind's efficiency: the one at which the
    priced time (roofline plus the profile's per-op cost) equals the measured time, found by
    bisection (memory-bound ops first, since matmuls and attention can be memory-bound in part).
    Microbenchmarks pin the machine's peaks; this fits what the model's shapes achieve of them
    (skinny matmuls, fresh activation memory). An efficiency stops at 1 (4 for memory, which is
    relative to the measured bandwidth curve)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from autopar import api
    from autopar.analysis import KIND_ATTN, KIND_MATMUL, KIND_OTHER, MATMUL_OPS
    from autopar.capture import default_loss
    from autopar.cost_models.compute import node_times

    hw = load_hardware(profile)
    ids = example_inputs[0]
    cuda = ids.is_cuda
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    loss_fn = loss_fn or default_loss
    model = model_factory()
    tgt = torch.roll(ids, -1, dims=1)

    def fwd_bwd():
        loss_fn(model(*example_inputs), tgt).backward()
        for p in model.parameters():
            p.grad = None

    def run(group):
        wall = _timeit(fwd_bwd, reps, sync, group)
        with torch_profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            fwd_bwd()
            sync()
        split = {KIND_MATMUL: 0.0, KIND_ATTN: 0.0, KIND_OTHER: 0.0}
        for e in prof.key_averages():
            t = e.self_device_time_total if cuda else e.self_cpu_time_total
            name = e.key.split("::")[-1]
            split[KIND_MATMUL if name in MATMUL_OPS else KIND_ATTN if "attention" in name else KIND_OTHER] += t
        return wall, split

    world = dist.get_world_size() if dist.is_initialized() else 1
    wall, split = _in_turns(hw.compute_slots or world, run)  # one rank's own speed, as in calibrate
    total = sum(split.values()) or 1.0
    measured = {k: wall * v / total for k, v in split.items()}
    slots = hw.compute_slots
    if slots and slots < world:
        # The same step on every rank at once: how much work the node really gets through with
        # all ranks busy (caches and memory are shared too), as a number of slots.
        t_all = _timeit(fwd_bwd, reps, sync)
        everyone = [None] * world
        dist.all_gather_object(everyone, world * wall / t_all)
        measured_slots = statistics.median(everyone)
        slots = 0.0 if measured_slots >= world else max(1.0, measured_slots)

    traced = api.profile_model(model, example_inputs=example_inputs, loss_fn=loss_fn).profile
    segments: dict = {}  # distinct node lists and how often they run
    for costs in [b.costs for b in traced.layer_sequence()] + [traced.pre.costs, traced.post.costs]:
        segments.setdefault(id(costs), [costs, 0])[1] += 1
    names = {KIND_MATMUL: "matmul", KIND_ATTN: "attention", KIND_OTHER: "memory"}
    eff = {**hw.efficiency, "matmul": 1.0, "attention": 1.0, "memory": 1.0}

    def priced(kind: int, e: dict) -> float:
        """The model's nodes of ``kind``, forward and backward, as the cost model prices them."""
        h = load_hardware({**hw.to_dict(), "efficiency": e})
        t = 0.0
        for costs, n in segments.values():
            ct = node_times(costs.subset(costs.kind == kind), h, mb=int(ids.shape[0]), tp=1, sp=False, compiled=False)
            t += n * (ct.fwd + ct.bwd)
        return t

    # Memory-bound ops first (matmuls and attention may be memory-bound in part), then the others.
    # Priced time falls as the efficiency grows: bisect (in log) for the one that matches.
    predicted = {}
    for kind, hi in ((KIND_OTHER, 4.0), (KIND_MATMUL, 1.0), (KIND_ATTN, 1.0)):
        key = names[kind]
        predicted[key] = priced(kind, {**eff, key: 1.0})
        lo, up = 0.01, hi
        if measured[kind] <= 0 or priced(kind, {**eff, key: up}) >= measured[kind]:
            eff[key] = up  # as fast as the bound allows, or nothing of this kind
            continue
        if priced(kind, {**eff, key: lo}) <= measured[kind]:
            eff[key] = lo
            continue
        for _ in range(40):
            mid = math.sqrt(lo * up)
            lo, up = (mid, up) if priced(kind, {**eff, key: mid}) > measured[kind] else (lo, mid)
        eff[key] = math.sqrt(lo * up)
    eff = {k: float(eff[k]) for k in ("matmul", "attention", "memory")}
    if dist.is_initialized():  # one profile for all ranks: the slowest rank's efficiencies
        allv = [None] * dist.get_world_size()
        dist.all_gather_object(allv, eff)
        eff = {k: min(v[k] for v in allv) for k in eff}
    prof_out = {**hw.to_dict(), "efficiency": {**hw.efficiency, **eff}, "compute_slots": slots,
                "note": (hw.note + "; " if hw.note else "") + f"compute efficiencies fitted to {traced.name} "
                        f"(batch {ids.shape[0]} x {ids.shape[1]})"}
    points = {"model": traced.name, "wall_s": wall,
              "measured_s": {names[k]: v for k, v in measured.items()},
              "predicted_at_full_efficiency_s": predicted, "efficiency": eff, "compute_slots": slots}
    return Calibration(prof_out, points)


def plot(cal: Calibration, path: str) -> bool:
    """Measured against fitted collective curves, as a PNG. False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    kinds = [k for k in COLLECTIVES if k in cal.points["collectives"]]
    fig, axes = plt.subplots(1, len(kinds), figsize=(4 * len(kinds), 3.5), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        for g, pts in cal.points["collectives"][kind].items():
            n = np.array([p[0] for p in pts], dtype=float)
            t = np.array([p[1] for p in pts], dtype=float)
            a, b = cal.profile["collectives"][kind][g]
            line = ax.loglog(n, t * 1e6, "o", label=f"{g} ranks")[0]
            ax.loglog(n, a + n / (b * 1e9) * 1e6, "-", color=line.get_color())
        ax.set_title(kind)
        ax.set_xlabel("bytes")
        ax.set_ylabel("microseconds")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return True


# ---------------------------------------------------------------------------------------------
# Measurements database
# ---------------------------------------------------------------------------------------------
def default_db_path() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "autopar", "measurements.sqlite")


class MeasurementDB:
    """SQLite file of measured step times, keyed by what makes a measurement reusable."""

    def __init__(self, path: str | None = None):
        self.path = path or default_db_path()
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        self.conn = sqlite3.connect(self.path)
        self.conn.execute(
            "CREATE TABLE IF NOT EXISTS measurements (fingerprint TEXT, mesh TEXT, hardware TEXT, "
            "torch TEXT, plan TEXT, step_time_s REAL, peak_memory_gb REAL, fits INTEGER, created REAL, "
            "PRIMARY KEY (fingerprint, mesh, hardware, torch, plan))"
        )

    @staticmethod
    def key(plan, hardware: str) -> tuple:
        return (plan.model_fingerprint, json.dumps(list(plan.mesh_shape)), hardware, torch.__version__,
                plan.as_config_string() + f",gb={plan.global_batch},seq={plan.seq_len},ac={plan.ac_summary()}")

    def get(self, plan, hardware: str) -> dict | None:
        row = self.conn.execute(
            "SELECT step_time_s, peak_memory_gb, fits FROM measurements WHERE fingerprint=? AND mesh=? "
            "AND hardware=? AND torch=? AND plan=?", self.key(plan, hardware)).fetchone()
        return None if row is None else {"step_time_s": row[0], "peak_memory_gb": row[1], "fits": bool(row[2])}

    def put(self, plan, hardware: str, m: dict) -> None:
        self.conn.execute("INSERT OR REPLACE INTO measurements VALUES (?,?,?,?,?,?,?,?,?)",
                          (*self.key(plan, hardware), m["step_time_s"], m["peak_memory_gb"], int(m["fits"]), time.time()))
        self.conn.commit()


def measure_plan(model_factory: Callable, plan, example_inputs: tuple, *, loss_fn=None, steps: int = 3,
                 compile: bool = False, memory_limit_gb: float | None = None) -> dict:
    """Run ``steps`` real steps of ``plan`` (after one warm-up) on a fresh model; all ranks call."""
    import autopar

    ids = example_inputs[0]
    tgt = torch.roll(ids, -1, dims=1)
    pm = autopar.compile(model_factory(), plan.world_size, example_inputs=example_inputs, plan=plan,
                         loss_fn=loss_fn, compile=compile)
    cuda = ids.is_cuda
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    pm.step(ids, target=tgt)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t = _timeit(lambda: pm.step(ids, target=tgt), steps, sync)
    times = torch.tensor([t], device=rank_device())
    if dist.is_initialized():
        dist.all_reduce(times, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else _cpu_peak_gb(pm, ids, tgt)
    limit = memory_limit_gb if memory_limit_gb is not None else float("inf")
    for p in pm.parameters():
        p.grad = None
    return {"step_time_s": float(times), "peak_memory_gb": peak, "fits": peak <= limit}


class PeakMemory:
    """Peak bytes of tensor storage during a call: parameters, gradients and optimizer state alive
    before it, plus every storage created inside it (a dispatch mode with finalizers). Works on
    any device; on GPUs ``torch.cuda.max_memory_allocated`` is used instead."""

    def __init__(self, baseline: int):
        self.live = self.peak = baseline
        self._seen: set = set()

    def _free(self, key, n):
        self._seen.discard(key)
        self.live -= n

    def measure(self, fn) -> int:
        import weakref

        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        tracker = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    if type(t) is torch.Tensor:
                        key = t.untyped_storage().data_ptr()
                        if key and key not in tracker._seen:
                            n = t.untyped_storage().nbytes()
                            tracker._seen.add(key)
                            tracker.live += n
                            tracker.peak = max(tracker.peak, tracker.live)
                            weakref.finalize(t, tracker._free, key, n)
                return out

        with Mode():
            fn()
        return self.peak


def _local_bytes(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def _cpu_peak_gb(pm, ids, tgt) -> float:
    params = list(pm.parameters())
    baseline = sum(_local_bytes(p) for p in params) * 2  # parameters and their gradients
    peak = torch.tensor([PeakMemory(baseline).measure(lambda: pm.step(ids, target=tgt)) / 2**30], device=rank_device())
    if dist.is_initialized():
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return float(peak)


def tune_plans(model_factory: Callable, candidates: list, example_inputs: tuple, *, hardware: str,
               db: MeasurementDB | None = None, steps: int = 3, loss_fn=None, compile: bool = False,
               memory_limit_gb: float | None = None) -> list[dict]:
    """Measure each candidate plan (reusing stored measurements); the list, fastest fitting first."""
    out = []
    for plan in candidates:
        stored = db.get(plan, hardware) if db is not None else None
        # Every rank must agree on whether to run (a collective decision).
        flag = torch.tensor([0 if stored is not None else 1], device=rank_device())
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item():
            m = measure_plan(model_factory, plan, example_inputs, loss_fn=loss_fn, steps=steps,
                             compile=compile, memory_limit_gb=memory_limit_gb)
            reused = False
            if db is not None and (not dist.is_initialized() or dist.get_rank() == 0):
                db.put(plan, hardware, m)
        else:
            m, reused = stored, True
        out.append({"plan": plan, "predicted_s": plan.predicted["step_time_s"], "measured_s": m["step_time_s"],
                    "peak_memory_gb": m["peak_memory_gb"], "fits": m["fits"], "reused": reused})
    out.sort(key=lambda r: (not r["fits"], r["measured_s"]))
    return out


def spearman(a: list[float], b: list[float]) -> float:
    ra = np.argsort(np.argsort(a))
    rb = np.argsort(np.argsort(b))
    return float(np.corrcoef(ra, rb)[0, 1]) if len(a) > 1 else 1.0


def calibrate_rank(base: str, max_bytes, reps: int, model_spec: str | None = None, batch: int = 1,
                    seq_len: int | None = None):
    import sys

    from rich.progress import Progress

    if dist.get_rank() == 0 and sys.stderr.isatty():
        with Progress(transient=True) as prog:
            task = prog.add_task("calibrating", total=None)
            cal = calibrate(base, max_bytes=max_bytes, reps=reps,
                            progress=lambda what, i, n: prog.update(task, completed=i, total=n, description=what))
    else:
        cal = calibrate(base, max_bytes=max_bytes, reps=reps)
    if model_spec:
        factory, ids = _model_inputs(model_spec, batch, seq_len)
        fit = calibrate_model(cal.profile, factory, (ids,), reps=reps)
        cal = Calibration(fit.profile, {**cal.points, "model": fit.points})
    return cal


def _model_inputs(model_spec: str, batch: int, seq_len: int | None):
    """A factory of the model (seeded, on this rank's GPU under NCCL) and token ids to feed it."""
    from autopar import models

    src = models.resolve(model_spec, seq_len=seq_len)
    seq = seq_len or src.seq_len
    ids = torch.randint(0, src.vocab_size or 256, (batch, seq), generator=torch.Generator().manual_seed(0))
    ids = ids.to(rank_device())

    def factory():
        torch.manual_seed(0)
        m = src.build()
        return m.cuda() if ids.is_cuda else m

    return factory, ids


def _tune_rank(model_spec: str, world: int, top: int, steps: int, plan_kw: dict, db_path: str | None):
    from autopar import api

    gb = plan_kw.get("global_batch") or world
    factory, ids = _model_inputs(model_spec, gb, plan_kw.get("seq_len"))
    hw = plan_kw.get("hardware") or ("h100" if ids.is_cuda else "cpu-gloo")
    cands = api.plan_candidates(factory(), world, k=top, example_inputs=(ids,), hardware=hw, global_batch=gb,
                                memory_limit_gb=plan_kw.get("memory_limit_gb"))
    db = MeasurementDB(db_path) if dist.get_rank() == 0 else None
    res = tune_plans(factory, cands, (ids,), hardware=load_hardware(hw).name, db=db, steps=steps,
                     memory_limit_gb=plan_kw.get("memory_limit_gb"))
    return [{**{k: v for k, v in r.items() if k != "plan"}, "plan_json": r["plan"].to_json()} for r in res]
