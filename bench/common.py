"""Shared helpers for the benchmark scripts: machine description and result writing."""

import json
import os
import platform
import time

import torch

RESULTS = os.path.join(os.path.dirname(__file__), "results")


def machine() -> dict:
    return {
        "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
        "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
    }


def write(name: str, rows: list[dict], summary: dict, columns: list[str], title: str, extra: dict | None = None) -> None:
    """``name``.json (machine, summary, rows and ``extra``) and ``name``.md (a table of ``columns``)."""
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, f"{name}.json"), "w") as f:
        json.dump({"machine": machine(), "summary": summary, "rows": rows, **(extra or {})}, f, indent=1, default=str)
    lines = [f"# {title}", "", f"Machine: {machine()}", ""]
    lines += [f"- {k}: {v}" for k, v in summary.items()] + [""]
    lines.append("| " + " | ".join(columns) + " |")
    lines.append("|" + "---|" * len(columns))
    for r in rows:
        lines.append("| " + " | ".join(_fmt(r.get(c, "")) for c in columns) + " |")
    with open(os.path.join(RESULTS, f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def allocator_peak_mib(fn) -> float:
    """``allocator_peaks(fn)``'s first: everything the allocator saw."""
    return allocator_peaks(fn)[0]


def allocator_peaks(fn) -> tuple[float, float]:
    """How much memory one step allocates at its peak beyond what the process holds before it
    (parameters and optimizer state, no gradients): gradients, saved activations, workspaces and
    communication buffers, Inductor's generated code's buffers included. The allocator's peak: on
    a GPU ``max_memory_allocated``; on CPU the running sum of the profiler's allocation events
    (every tensor the step allocates and frees, through PyTorch's CPU allocator), which is what a
    GPU's allocator would count (the process's resident set adds glibc arenas, gloo's own
    buffers and thread stacks: 1.5-2x more on these runs, and not what the planner prices).

    Returns that peak and the same peak without what the process group's backend allocates
    inside a collective (gloo's staging copies, under ``gloo:*`` and ``c10d::*`` ops): NCCL
    allocates no such tensors from the caching allocator, and how long gloo holds them depends on its threads' timing (a
    prefetched gather's staging buffer, alive or not at the peak, moves it by a layer's weights).
    The collectives' outputs (``_c10d_functional``, FSDP2's own buffers) are counted either way."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        return peak, peak
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = []  # (time, pointer, bytes (negative: freed), allocated inside the backend)

    def walk(e, inside: bool) -> None:
        inside = inside or e.name.startswith(("gloo:", "c10d::"))
        if e.tag == _EventType.Allocation:
            events.append((e.start_time_ns, e.extra_fields.ptr, e.extra_fields.alloc_size, inside))
        for c in e.children:
            walk(c, inside)

    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root, False)
    staged: set = set()
    live = peak = own = own_peak = 0
    for _, ptr, nbytes, inside in sorted(events, key=lambda x: x[0]):
        live += nbytes
        peak = max(peak, live)
        if nbytes > 0 and inside:
            staged.add(ptr)
        elif ptr in staged:  # a staging buffer freed
            staged.discard(ptr)
        else:
            own += nbytes
            own_peak = max(own_peak, own)
    return peak / 2**20, own_peak / 2**20


def spawn_ranks(world: int, worker, *args, timeout: float = 3000) -> dict:
    """Run ``worker(rank, world, port, *args, q)`` in ``world`` spawned processes; each puts
    ``(rank, result)`` on ``q``. Returns {rank: result}."""
    import torch.multiprocessing as mp

    from tests.dist_harness import free_port

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=worker, args=(r, world, port, *args, q)) for r in range(world)]
    for p in procs:
        p.start()
    out = dict(q.get(timeout=timeout) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    return out
