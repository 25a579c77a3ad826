"""The backend: split the joint graph into forward and backward graphs, and compile each.

The partition is functorch's min-cut partitioner (what ``torch.compile`` uses): it decides what
the forward saves for the backward, honours the recompute tags of ``passes/ac.py``, and returns
``fw: primals -> (*outputs, *saved)`` and ``bw: (*saved, *tangents) -> gradients``. Inductor
compiles each graph whole (``torch._inductor.standalone_compile``, the one call into it); with
``compile=False`` the very same graphs run eagerly, so the debug path and the default path differ
only in code generation.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch._functorch.partitioners import min_cut_rematerialization_partition

log = logging.getLogger(__name__)


@dataclass
class CompiledStep:
    fw: Callable
    bw: Callable
    fw_graph: torch.fx.GraphModule
    bw_graph: torch.fx.GraphModule
    n_outputs: int
    compile_s: float = 0.0
    bw_strides: list = None  # the strides the backward graph's inputs were traced with


def partition(joint: torch.fx.GraphModule, n_outputs: int) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    return min_cut_rematerialization_partition(joint, None, num_fwd_outputs=n_outputs)


def _example(gm: torch.fx.GraphModule) -> list:
    return [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]


def _fake_mode(vals: list):
    from torch._guards import detect_fake_mode

    return detect_fake_mode(vals)


def compile_graph(gm: torch.fx.GraphModule, inductor: bool) -> Callable:
    if not inductor:
        return gm
    vals = _example(gm)
    with torch.no_grad():
        art = torch._inductor.standalone_compile(gm, vals, dynamic_shapes="from_example_inputs",
                                                 fake_mode=_fake_mode(vals))
    return art


def build(joint: torch.fx.GraphModule, n_outputs: int, inductor: bool) -> CompiledStep:
    """Partition and compile. With several processes, rank 0 compiles first and the others
    after it: ranks with the same graph (TP and data-parallel ranks have the same one) then load
    Inductor's cached code instead of compiling it again on the same cores."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    fw, bw = partition(joint, n_outputs)
    ordered = inductor and dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "fake"
    if ordered and dist.get_rank() != 0:
        dist.barrier()
    try:
        step = CompiledStep(compile_graph(fw, inductor), compile_graph(bw, inductor), fw, bw, n_outputs)
    finally:
        if ordered and dist.get_rank() == 0:
            dist.barrier()
    step.bw_strides = [tuple(v.stride()) if isinstance(v, torch.Tensor) else None for v in _example(bw)]
    step.compile_s = time.perf_counter() - t0
    log.info("backend: partition + %s in %.1fs", "Inductor" if inductor else "eager", step.compile_s)
    return step
