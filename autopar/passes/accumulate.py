"""Gradients accumulated where they are made, for parameters gathered once per step (ZeRO-1).

Under ``Plan.fsdp_once == "gather"`` the backward graph makes each parameter's whole gradient of
one microbatch, which the runtime adds into that parameter's buffer for the step (``zero.py``).
Returned as graph outputs, every layer's gradients would be alive together at the backward's
end, beside the buffers (one more copy of the model's gradients). This pass gives the backward
(or, under a zero-bubble schedule, its weight-gradient part) one more input per such gradient,
the buffer, and adds the gradient into it in place right after the node that makes it
(``autopar::accumulate_``, in the buffer's reduce dtype), returning None in its
place; so a gradient lives from its making to its addition, as autograd's accumulation into
``.grad`` does.
"""

from __future__ import annotations

import torch

# The meta key of an accumulator input (``memory.py``: held by the rank, not the step's).
ACCUMULATOR = "autopar_accumulator"


@torch.library.custom_op("autopar::accumulate_", mutates_args=("acc",))
def accumulate_(acc: torch.Tensor, g: torch.Tensor) -> None:
    """``acc += g`` in place (``g`` cast to ``acc``'s dtype). An op of its own: written as
    ``aten.add_``, Inductor folds the addition into the matmul that makes ``g`` (``addmm``) and
    writes the sum to a new buffer, copied into ``acc`` only at the graph's end, so every
    layer's sums would be alive together."""
    acc.add_(g)


@accumulate_.register_fake
def _(acc, g):
    return None


def accumulate(graphs, plan, ctx):
    """The backward graphs (flat and with layer calls) of ``graphs`` with the gradients at
    ``ctx.step.accumulate`` (output positions) added into accumulator inputs."""
    positions = ctx.step.accumulate
    reduce = ctx.step.layout.reduce
    names = ("bw_weight", "bw_weight_regions") if graphs.bw_weight is not None else ("bw", "bw_regions")
    for name in names:
        gm = getattr(graphs, name)
        if gm is not None:
            done = into_accumulators(gm, positions, reduce)
    ctx.step.accumulate = done  # the runtime hands the graph a buffer for each of these
    return graphs


def into_accumulators(gm: torch.fx.GraphModule, positions: list[int], reduce: torch.dtype | None) -> list[int]:
    """In place: output ``j`` of ``gm`` (for ``j`` in ``positions`` where it is not None) added
    into a new input (after the others, in ``positions`` order) in ``reduce`` dtype
    (``zero.cast_dtype``), and returned as None. Returns the positions done."""
    from autopar.zero import cast_dtype

    g = gm.graph
    out = g.output_node()
    vals = list(out.args[0])
    last = list(g.find_nodes(op="placeholder"))[-1]
    accs = {}
    for j in positions:  # the inputs first, after the graph's own
        src = vals[j]
        if src is None:
            continue
        val = src.meta["val"]
        dtype = cast_dtype(val, reduce)
        with g.inserting_after(last):
            last = accs[j] = g.placeholder(f"acc_{j}")
        with val.fake_mode:
            last.meta["val"] = torch.empty(val.shape, dtype=dtype, device=val.device)
        last.meta[ACCUMULATOR] = True
    for j, acc in accs.items():
        src = vals[j]
        with g.inserting_after(last if src.op == "placeholder" else src):
            add = g.call_function(torch.ops.autopar.accumulate_.default, (acc, src))
        add.meta["val"] = None
        dtype = acc.meta["val"].dtype
        if src.meta["val"].dtype != dtype:
            # Cast in the graph, where Inductor can fuse it into the kernel making the gradient
            # and the memory walk sees it (inside the op ``add_`` would make the copy itself).
            with g.inserting_before(add):
                cast = g.call_function(torch.ops.prims.convert_element_type.default, (src, dtype))
            with src.meta["val"].fake_mode:
                cast.meta["val"] = torch.ops.prims.convert_element_type.default(src.meta["val"], dtype)
            add.args = (acc, cast)
        vals[j] = None
    out.args = (type(out.args[0])(vals),)
    g.lint()
    gm.recompile()
    return list(accs)
