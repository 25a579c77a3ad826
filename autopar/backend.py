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
import operator
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch._functorch.partitioners import min_cut_rematerialization_partition

# Importing overlap also registers autopar::copy_out, which the compiled graphs call.
from autopar.passes.overlap import schedule

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
    # Zero-bubble schedules: the backward split into input and weight gradients (split_backward).
    bw_input: Callable | None = None
    bw_weight: Callable | None = None
    n_input_grads: int = 0
    bw_weight_strides: list = None
    inductor: bool = True  # compiled by Inductor (False: the graphs run as they are)


@dataclass
class DPCollectives:
    """What ``passes/overlap.py`` needs to schedule the data-parallel collectives of a step."""

    param_layer: list  # parameter index -> its repeated layer (None outside the layers)
    grad_param: list  # backward output -> the parameter whose gradient it is (None otherwise)
    groups: set  # names of the data-parallel process groups
    prefetch: int = 1  # buckets gathered ahead of use
    merge: bool = True  # one collective per bucket (False: one per parameter)


def partition(joint: torch.fx.GraphModule, n_outputs: int) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    return min_cut_rematerialization_partition(joint, None, num_fwd_outputs=n_outputs)


def split_backward(bw: torch.fx.GraphModule, n_weight: int) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule, int]:
    """Split the backward graph for zero-bubble pipeline schedules into the input-gradient part
    ``I: (*saved, *tangents) -> (*input grads, *carried)`` and the weight-gradient part
    ``W: (*carried) -> (*weight grads)``. The backward's outputs are the weight gradients (the
    first ``n_weight``) then the input gradients. ``I`` holds every node an input gradient
    depends on; ``W`` the rest; ``carried`` are the values of ``I`` (saved tensors, tangents or
    intermediates) that ``W`` reads. Returns (I, W, number of input gradients)."""
    g = bw.graph
    (out,) = g.find_nodes(op="output")
    outs = list(out.args[0]) if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    w_outs, i_outs = outs[:n_weight], outs[n_weight:]

    def ancestors(roots) -> set:
        seen, stack = set(), [r for r in roots if isinstance(r, torch.fx.Node)]
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            stack += n.all_input_nodes
        return seen

    in_i = ancestors(i_outs)
    in_w = ancestors(w_outs) - in_i
    # A multi-output op in I (layer norm's backward: input, weight and bias gradients) hands W
    # its items, not the tuple: a graph's inputs and outputs are tensors.
    items = {n for n in in_w if n.target is operator.getitem and n.args[0] in in_i}
    in_i |= items
    in_w -= items
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    stray = [n for n in g.nodes if n.op not in ("placeholder", "output") and n not in in_i and n not in in_w]
    if stray:
        raise RuntimeError(f"backward nodes outside both gradient parts: {[n.name for n in stray[:5]]}")
    carried = [n for n in g.nodes if n in in_i and (any(u in in_w for u in n.users) or n in w_outs)]
    carried += [n for n in placeholders if n not in in_i and any(u in in_w for u in n.users)]

    gi, env = torch.fx.Graph(), {}
    for n in g.nodes:
        if n.op == "placeholder":
            env[n] = gi.node_copy(n)
        elif n in in_i:
            env[n] = gi.node_copy(n, lambda a: env[a])
    gi.output([env[x] if isinstance(x, torch.fx.Node) else x for x in i_outs] + [env[c] for c in carried])
    gw, envw = torch.fx.Graph(), {}
    for c in carried:
        ph = gw.placeholder(f"carried_{c.name}")
        ph.meta = dict(c.meta)
        envw[c] = ph
    for n in g.nodes:
        if n in in_w and n.op != "placeholder":  # W's placeholders are the carried values
            envw[n] = gw.node_copy(n, lambda a: envw[a])
    gw.output([envw[x] if isinstance(x, torch.fx.Node) else x for x in w_outs])
    gi.lint()
    gw.lint()
    return torch.fx.GraphModule(bw, gi), torch.fx.GraphModule(bw, gw), len(i_outs)


def _example(gm: torch.fx.GraphModule) -> list:
    return [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]


def _fake_mode(vals: list):
    from torch._guards import detect_fake_mode

    return detect_fake_mode(vals)


def compile_graph(gm: torch.fx.GraphModule, inductor: bool) -> Callable:
    """``gm`` compiled (or, without Inductor, run as is) as a *boxed* callable: it takes one list
    of inputs and empties it, so an input whose only reference was that list is freed at its
    last use inside the graph (the backward frees each saved activation once it is consumed,
    as autograd does, instead of holding every one to the end)."""
    if not inductor:
        import copy

        from torch.fx.graph import _BoxedCodeGen

        boxed = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
        boxed.graph.set_codegen(_BoxedCodeGen())
        boxed.recompile()
        return boxed
    vals = _example(gm)
    # The graphs are partitioned already (passes/ac.py decided what the backward recomputes):
    # AOTAutograd's forward-loss-backward rematerialisation must not look for backward regions
    # in them (with MoE blocks under TP and selective AC it found several in the forward graph
    # and refused to compile: "disjoint backward regions that require recomputation").
    # Inductor's peak-memory reordering is off: the graph's order (gathers at use, prefetch, the
    # reductions' waits: passes/overlap.py) is the schedule that runs and that memory.py prices.
    with torch.no_grad(), torch._functorch.config.patch(remat_using_tags_for_fwd_loss_bwd_graph=False), \
            torch._inductor.config.patch(reorder_for_peak_memory=False):
        art = torch._inductor.standalone_compile(gm, vals, dynamic_shapes="from_example_inputs", **_fake_mode_kw(vals))
    return _boxed(art)


def _fake_mode_kw(vals) -> dict:
    """``standalone_compile``'s ``fake_mode`` argument, where this torch has it (2.13 does; the
    2.11 that GPU images carry does not, and infers the mode from the inputs)."""
    import inspect

    if "fake_mode" in inspect.signature(torch._inductor.standalone_compile).parameters:
        return {"fake_mode": _fake_mode(vals)}
    return {}


def _boxed(art) -> Callable:
    """The boxed function inside a ``standalone_compile`` artifact: AOTAutograd's compiled
    function, which takes a list and steals its items (the artifact's own ``__call__`` and the
    wrappers above it take ``*args``, which would keep every input alive to the end). The
    constants AOTAutograd lifted out of the graph (its ``params_buffers_flat``) go first."""
    import inspect

    fn, lifted = getattr(art, "_compiled_fn", None), None
    while fn is not None:
        if inspect.isfunction(fn) and lifted is None:
            lifted = inspect.getclosurevars(fn).nonlocals.get("params_buffers_flat")
        if type(fn).__name__ == "SerializableCompiledFunction" or getattr(fn, "__name__", "") == "runtime_wrapper":
            if lifted is None:
                break  # not the layout this was written against: use the artifact as it is
            inner, prefix = fn, list(lifted)

            def call(args: list):
                args[:0] = prefix
                return inner(args)

            return call
        fn = getattr(fn, "__wrapped__", None)
    log.info("backend: no boxed entry in the compiled artifact; inputs are held until it returns")

    def unboxed(args: list):
        items = list(args)
        args.clear()
        return art(*items)

    return unboxed


class _Progress:
    """``compile_graph`` that tells the terminal which graph Inductor compiles and how long it
    took (rank 0 only: the others wait for it and then load its cached code; ``AUTOPAR_QUIET=1``
    silences it)."""

    def __init__(self, inductor: bool, show: bool, total: int):
        self.inductor, self.total, self.done = inductor, total, 0
        self.show = inductor and show and not os.environ.get("AUTOPAR_QUIET")

    def __call__(self, gm: torch.fx.GraphModule, what: str) -> Callable:
        self.done += 1
        if not self.show:
            return compile_graph(gm, self.inductor)
        ops = sum(n.op == "call_function" for n in gm.graph.nodes)
        print(f"autopar: Inductor compiles the {what} graph ({self.done}/{self.total}, {ops} ops)...",
              file=sys.stderr, flush=True)
        t = time.perf_counter()
        out = compile_graph(gm, self.inductor)
        print(f"autopar: {what} graph compiled in {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
        return out


def build(joint: torch.fx.GraphModule, n_outputs: int, inductor: bool, split_weight: int | None = None,
          dp: DPCollectives | None = None) -> CompiledStep:
    """Partition and compile. With several processes, rank 0 compiles first and the others
    after it: ranks with the same graph (TP and data-parallel ranks have the same one) then load
    Inductor's cached code instead of compiling it again on the same cores."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    fw, bw = partition(joint, n_outputs)
    if dp is not None:  # passes/overlap.py: per-layer buckets, gathered at use, prefetched
        kw = dict(param_layer=dp.param_layer, dp_groups=dp.groups, prefetch=dp.prefetch, merge=dp.merge)
        fw = schedule(fw, grad_param=[], **kw)
        bw = schedule(bw, grad_param=dp.grad_param, **kw)
    ordered = inductor and dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "fake"
    if ordered and dist.get_rank() != 0:
        dist.barrier()
    compiled = _Progress(inductor, not dist.is_initialized() or dist.get_rank() == 0, 2 if split_weight is None else 3)
    try:
        if split_weight is None:
            step = CompiledStep(compiled(fw, "forward"), compiled(bw, "backward"), fw, bw, n_outputs)
        else:  # the backward runs as its two parts only
            step = CompiledStep(compiled(fw, "forward"), None, fw, bw, n_outputs)
            bw_i, bw_w, step.n_input_grads = split_backward(bw, split_weight)
            step.bw_input = compiled(bw_i, "backward (input gradients)")
            step.bw_weight = compiled(bw_w, "backward (weight gradients)")
            step.bw_weight_strides = [tuple(v.stride()) if isinstance(v, torch.Tensor) else None
                                      for v in _example(bw_w)]
    finally:
        if ordered and dist.get_rank() == 0:
            dist.barrier()
    step.inductor = inductor
    step.bw_strides = [tuple(v.stride()) if isinstance(v, torch.Tensor) else None for v in _example(bw)]
    step.compile_s = time.perf_counter() - t0
    log.info("backend: partition + %s in %.1fs", "Inductor" if inductor else "eager", step.compile_s)
    return step
