"""Benchmark-driven tuning: measure the machine, fit the cost model to it, measure candidate plans.

Calibration (``autopar tune calibrate``), on every rank at once so that contention between the
processes of one machine is part of what is measured:

- matmul throughput (fp32 on CPU; bf16 on GPUs) over square and skinny shapes, sustained for
  0.2 s per timing so that processes sharing cores contend as in training;
- fused attention (``scaled_dot_product_attention``, causal) throughput;
- memory bandwidth (a large element-wise op) and the fixed cost of one small op;
- all-reduce, all-gather, reduce-scatter, all-to-all and send/recv over every power-of-two group
  size up to N and messages from 1 KiB up.

Fits: matmul and attention efficiency against the profile's peak (the peak is raised to the
measurement when a data sheet is unknown, as for CPUs); measured memory bandwidth; per-op cost;
and for each collective and group size an alpha-beta line ``t = alpha + bytes / beta`` by least
squares, which the cost model then uses instead of its analytic ring model.

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
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from autopar.cost_models.hardware import Hardware, load as load_hardware

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


def _timeit(fn: Callable, reps: int, sync: Callable = lambda: None, group=None) -> float:
    """Median seconds of ``fn`` over ``reps`` runs after one warm-up, ranks in step."""
    fn()
    sync()
    out = []
    for _ in range(reps):
        if dist.is_initialized():
            dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def _sustained(fn: Callable, reps: int, sync: Callable, seconds: float = 0.2) -> float:
    """Seconds per call of ``fn`` over runs of at least ``seconds``: long enough that processes
    sharing cores actually contend, as they do while training (short runs get serialised)."""
    probe = _timeit(fn, 1, sync)
    n = max(1, int(seconds / max(probe, 1e-6)))

    def many():
        for _ in range(n):
            fn()

    return _timeit(many, reps, sync) / n


def fit_alpha_beta(sizes: list[float], times: list[float]) -> tuple[float, float]:
    """Least squares ``t = alpha + n / beta``: (alpha in microseconds, beta in GB/s)."""
    A = np.stack([np.ones(len(sizes)), np.asarray(sizes, dtype=np.float64)], axis=1)
    (alpha, inv_beta), *_ = np.linalg.lstsq(A, np.asarray(times, dtype=np.float64), rcond=None)
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
    points: dict = {"matmul": [], "attention": [], "memory": [], "collectives": {}}
    steps = [0]
    sizes = [1 << k for k in range(10, int(math.log2(max_bytes)) + 1, 2)]
    groups = [g for g in (2 ** i for i in range(1, 16)) if g <= world]
    total = 3 + ((len(COLLECTIVES) - 1) * len(groups) + 1) * len(sizes)

    def tick(what: str):
        steps[0] += 1
        if progress and rank == 0:
            progress(what, steps[0], total)

    shapes = [(2048, 2048, 2048), (4096, 1024, 4096), (8192, 8192, 8192)] if cuda else [(256, 256, 256), (512, 512, 512), (1024, 512, 1024)]
    best = 0.0
    for m, k, n in shapes:
        a, b = torch.randn(m, k, dtype=dtype, device=device), torch.randn(k, n, dtype=dtype, device=device)
        t = _sustained(lambda: a @ b, reps, sync)
        rate = 2 * m * k * n / t
        points["matmul"].append({"shape": [m, k, n], "tflops": rate / 1e12})
        best = max(best, rate)
    tick("matmul")
    b_, h_, s_, d_ = (4, 16, 2048, 128) if cuda else (2, 4, 256, 32)
    q = torch.randn(b_, h_, s_, d_, dtype=dtype, device=device)
    t = _sustained(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True), reps, sync)
    attn_rate = 4 * b_ * h_ * s_ * s_ * d_ * 0.5 / t
    points["attention"].append({"shape": [b_, h_, s_, d_], "tflops": attn_rate / 1e12})
    tick("attention")
    # Element-wise bandwidth by size: the largest is memory; smaller ones may fit in a cache.
    by_size = {}
    for mb in ((1, 4, 16, 64, 256) if cuda else (0.25, 1, 4, 16, 64)):
        x = torch.ones(int(mb * (1 << 20)) // 4, device=device)
        t = _sustained(lambda: x.add(1.0), reps, sync)
        by_size[mb] = 2 * x.numel() * 4 / t
    bw = by_size[max(by_size)]
    cache_bw = max(by_size.values())
    cached = [mb for mb, b in by_size.items() if b >= (cache_bw + bw) / 2 and mb < max(by_size)]
    cache_mb = 2 * max(cached) if cached and cache_bw > 1.5 * bw and not cuda else 0.0
    points["memory_by_size"] = {str(k): v / 1e9 for k, v in by_size.items()}
    small = torch.ones(8, device=device)
    t_small = _sustained(lambda: small.add(1.0), reps, sync)
    points["memory"].append({"gbps": bw / 1e9, "op_us": t_small * 1e6})
    tick("memory")

    fitted: dict = {}
    # Every rank creates every group, in the same order (new_group is collective).
    group_of = {g: dist.new_group(list(range(g))) if dist.is_initialized() else None for g in groups}
    for kind in COLLECTIVES:
        for g in groups:
            if kind == "send_recv" and g > 2:
                continue  # point-to-point is between two ranks
            ranks = list(range(g))
            group = group_of[g]
            member = rank < g
            ts = []
            for nbytes in sizes:
                if member and not (kind == "send_recv" and rank >= 2):
                    fn = _collective(kind, nbytes, group, g, device, ranks.index(rank))
                    tt = _timeit(fn, reps, sync, group=group)
                else:
                    tt = None
                ts.append(tt)
                tick(f"{kind} over {g}")
            mine = [(n, t) for n, t in zip(sizes, ts) if t is not None]
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
        cache_mb=cache_mb, cache_bandwidth_gbps=cache_bw / 1e9 if cache_mb else 0.0,
        efficiency={**hw.efficiency, "matmul": min(1.0, best / peak), "attention": min(1.0, attn_rate / peak), "memory": 1.0},
        note=f"calibrated by autopar tune on {world} {'GPU' if cuda else 'CPU'} processes, torch {torch.__version__}",
    )
    return Calibration(prof, points)


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
    times = torch.tensor([t])
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
    peak = torch.tensor([PeakMemory(baseline).measure(lambda: pm.step(ids, target=tgt)) / 2**30])
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
        flag = torch.tensor([0 if stored is not None else 1])
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


# ---------------------------------------------------------------------------------------------
# Launching the measurements on N local processes (the CLI)
# ---------------------------------------------------------------------------------------------
def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank: int, world: int, port: int, backend: str, fn, args, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    if backend == "gloo":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    else:
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        out = fn(*args)
        q.put((rank, out, None))
    except Exception as e:  # pragma: no cover - reported to the parent
        import traceback

        q.put((rank, None, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        dist.barrier()
        dist.destroy_process_group()


def launch(nproc: int, backend: str, fn, *args):
    """Run ``fn(*args)`` on ``nproc`` local processes in one process group; rank 0's result."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, nproc, port, backend, fn, args, q)) for r in range(nproc)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        rank, out, err = q.get(timeout=7200)
        if err:
            for p in procs:
                p.terminate()
            from autopar.errors import AutoparError

            raise AutoparError(f"rank {rank} failed: {err}")
        results[rank] = out
    for p in procs:
        p.join(timeout=120)
    return results[0]


def _calibrate_rank(base: str, max_bytes, reps: int):
    from rich.progress import Progress
    import sys

    if dist.get_rank() == 0 and sys.stderr.isatty():
        with Progress(transient=True) as prog:
            task = prog.add_task("calibrating", total=None)
            cal = calibrate(base, max_bytes=max_bytes, reps=reps,
                            progress=lambda what, i, n: prog.update(task, completed=i, total=n, description=what))
    else:
        cal = calibrate(base, max_bytes=max_bytes, reps=reps)
    return cal


def _tune_rank(model_spec: str, world: int, top: int, steps: int, plan_kw: dict, db_path: str | None):
    from autopar import api, models

    src = models.resolve(model_spec, seq_len=plan_kw.get("seq_len"))
    seq = plan_kw.get("seq_len") or src.seq_len
    gb = plan_kw.get("global_batch") or world
    torch.manual_seed(0)
    vocab = src.vocab_size or 256
    ids = torch.randint(0, vocab, (gb, seq), generator=torch.Generator().manual_seed(0))
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        ids = ids.cuda()

    def factory():
        torch.manual_seed(0)
        m = src.build()
        return m.cuda() if ids.is_cuda else m

    hw = plan_kw.get("hardware") or ("h100" if ids.is_cuda else "cpu-gloo")
    cands = api.plan_candidates(factory(), world, k=top, example_inputs=(ids,), hardware=hw, global_batch=gb,
                                memory_limit_gb=plan_kw.get("memory_limit_gb"))
    db = MeasurementDB(db_path) if dist.get_rank() == 0 else None
    res = tune_plans(factory, cands, (ids,), hardware=load_hardware(hw).name, db=db, steps=steps,
                     memory_limit_gb=plan_kw.get("memory_limit_gb"))
    return [{**{k: v for k, v in r.items() if k != "plan"}, "plan_json": r["plan"].to_json()} for r in res]
