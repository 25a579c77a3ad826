"""Bucketing: one collective per bucket of parameters instead of one per parameter.

Runs on the partitioned forward and backward graphs, before Inductor: the FSDP all-gathers of
parameters (SimpleFSDP's: each derives from one parameter placeholder), the gradient
reduce-scatters that flow to the graph's outputs, and the data-parallel gradient all-reduces
(DDP/HSDP groups only, never TP's) are merged where they are adjacent in the graph and
independent, with Inductor's bucketing passes (a merged collective is one flat buffer, split
back into the same tensors: the values are unchanged). Each bucket holds at most one layer's
parameters, so the gather for one layer still overlaps the previous layer's compute, which is
how the cost model prices FSDP (one all-gather and one reduce-scatter per layer).
"""

from __future__ import annotations

import math

import torch


def layer_cap_mb(sg, param_shapes: list, elem_bytes: int) -> float:
    """The largest layer's parameter bytes (whole, as gathered) in MiB: the bucket cap."""
    per_layer: dict[str, int] = {}
    for name, shape in zip(sg.param_names, param_shapes):
        layer = next((f for f in sg.layers if name.startswith(f + ".")), None)
        if layer is not None:
            per_layer[layer] = per_layer.get(layer, 0) + math.prod(shape) * elem_bytes
    if not per_layer:
        return 25.0  # no repeated layers: buckets of 25 MiB, as DDP does
    return max(per_layer.values()) * 1.001 / 2**20


def bucket(gm: torch.fx.GraphModule, cap_mb: float, dp_groups: set[str]) -> torch.fx.GraphModule:
    """Merge ``gm``'s FSDP/DP collectives into buckets of at most ``cap_mb`` MiB (in place)."""
    from torch._inductor.fx_passes.fsdp import bucket_fsdp_all_gather, bucket_fsdp_all_reduce, bucket_fsdp_reduce_scatter
    from torch.utils._ordered_set import OrderedSet

    def cap(_bucket_index: int) -> float:
        return cap_mb

    one_wait_each(gm)
    bucket_fsdp_all_gather(gm, cap)
    bucket_fsdp_reduce_scatter(gm, cap)
    if dp_groups:
        bucket_fsdp_all_reduce(gm, cap, OrderedSet(dp_groups))
    gm.graph.lint()
    gm.recompile()
    return gm


def one_wait_each(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Each collective waited once, as Inductor's bucketing requires. Two parameters whose
    gradients are one computation (GPT-NeoX's parallel attention and MLP output biases: both the
    sum of the same residual gradient) get one collective from common-subexpression elimination,
    waited twice; the later wait's users take the first's result (the same tensor)."""
    wait = torch.ops._c10d_functional.wait_tensor.default
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in list(gm.graph.nodes):
        waits = sorted((u for u in n.users if u.op == "call_function" and u.target is wait), key=order.get)
        for w in waits[1:]:
            w.replace_all_uses_with(waits[0])
            gm.graph.erase_node(w)
    return gm
