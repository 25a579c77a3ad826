"""Running a function on N local processes: the one launcher of the CLI's ``tune`` and
``calibrate``, the demo, the benchmarks and the multi-process tests.

``spawn`` starts the processes and collects what each reports; a rank that raises, or dies, stops
the launch (its peers, which may wait for it in a collective, get a few seconds to report and are
then terminated), so no failure leaves the others hanging. ``run`` is ``spawn`` with a process
group made on every rank first.
"""

from __future__ import annotations

import inspect
import os
import queue
import socket
import time
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from autopar.errors import AutoparError


@dataclass
class Failed:
    """What a rank reports instead of a result when its function raised."""

    rank: int
    message: str


@dataclass
class Launch:
    """What the ranks reported (each rank's results in order), the failures in the order they came
    (the first is the cause: the others are usually peers losing it), how each process ended
    (``None``: still running when it was terminated), and whether the launch ran out of time."""

    results: dict[int, list] = field(default_factory=dict)
    failures: list[Failed] = field(default_factory=list)
    exitcodes: list = field(default_factory=list)
    timed_out: bool = False


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _child(rank: int, world: int, port: int, q, target, args) -> None:
    try:
        out = target(rank, world, port, *args)
        for x in out if inspect.isgenerator(out) else (out,):
            q.put((rank, x))
    except Exception as e:
        q.put((rank, Failed(rank, f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}")))
        raise SystemExit(1) from None


def spawn(world: int, target, *args, expect: int = 1, timeout: float = 3000.0, grace: float = 20.0,
          failed=None) -> Launch:
    """Run ``target(rank, world, port, *args)`` in ``world`` spawned processes (``port``: a free
    one for the process group's store). ``target`` returns its result, or is a generator whose
    results are sent as they come; an exception is reported as ``Failed``. Waits until every rank
    has reported ``expect`` results or ``timeout`` seconds have passed; once a rank fails (reports
    ``Failed``, or a result for which ``failed(result)`` is true, or its process dies) the others
    get ``grace`` seconds, then every process still running is terminated."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(r, world, port, q, target, args)) for r in range(world)]
    for p in procs:
        p.start()
    out = Launch(results={r: [] for r in range(world)})
    deadline = time.monotonic() + timeout
    failed_at = None
    while sum(map(len, out.results.values())) < world * expect:
        end = deadline if failed_at is None else min(deadline, failed_at + grace)
        try:
            rank, res = q.get(timeout=min(max(end - time.monotonic(), 0.1), 2.0))
        except queue.Empty:
            if time.monotonic() >= end:
                out.timed_out = failed_at is None
                break
            if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
                failed_at = time.monotonic()
            continue
        out.results[rank].append(res)
        if isinstance(res, Failed):
            out.failures.append(res)
        if failed_at is None and (isinstance(res, Failed) or (failed is not None and failed(res))):
            failed_at = time.monotonic()
    for p in procs:
        p.join(timeout=30 if failed_at is None and not out.timed_out else 0.1)
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
    out.exitcodes = [p.exitcode for p in procs]
    return out


def _group_rank(rank: int, world: int, port: int, backend: str, fn, args):
    """One rank of ``run``: its process group (gloo: the cores shared out; nccl: GPU ``rank``),
    then ``fn(*args)``, then the group ended on every rank."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    if backend == "gloo":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    else:
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    out = fn(*args)  # if it raises, no shutdown: its barrier would wait for peers that may wait for this rank
    from autopar.runtime import shutdown

    shutdown()
    return out


def run(world: int, backend: str, fn, *args, timeout: float = 7200.0) -> list:
    """``fn(*args)`` on every rank of a process group of ``world`` local processes; each rank's
    result, in rank order. A rank that fails raises ``AutoparError`` with its traceback."""
    res = spawn(world, _group_rank, backend, fn, args, timeout=timeout)
    if res.failures:
        raise AutoparError(res.failures[0].message)
    missing = [r for r in range(world) if not res.results[r]]
    if missing:
        raise AutoparError(f"rank(s) {missing} reported nothing (exit codes {res.exitcodes}"
                           f"{', timed out' if res.timed_out else ''})")
    return [res.results[r][0] for r in range(world)]
