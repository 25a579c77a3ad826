"""Activation checkpointing and ZeRO-3 resharding as recompute tags on the joint graph.

For every forward node of a layer whose plan says ``full``, ``node.meta["recompute"]`` is
``PREFER_RECOMPUTE``; under ``selective`` the outputs of matmuls and attention kernels are
``MUST_SAVE`` and the rest ``PREFER_RECOMPUTE`` (op-level selective AC). ``ac_graph_id`` is the
layer, so each layer is its own region. Ops tagged ``nondeterministic_seeded`` (the CPU flash
attention kernel is one) are always saved: recomputing them would not reproduce their output.
When the plan reshards after forward (ZeRO-3), each parameter's gather is ``MUST_RECOMPUTE``:
the backward gathers it again instead of keeping it. The min-cut partitioner (``backend``)
honours the tags, as it does for ``torch.utils.checkpoint`` regions.
"""

from __future__ import annotations

import operator

import torch
from torch.utils.checkpoint import CheckpointPolicy

from autopar.passes import PassContext

_aten = torch.ops.aten
SAVE_OPS = {
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default,
    _aten._scaled_dot_product_flash_attention.default, _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default, _aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def forward_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """Nodes of the joint graph that do not depend on a tangent (the forward part)."""
    backward = set()
    for n in gm.graph.nodes:
        if (n.op == "placeholder" and n.name.startswith("tangents")) or any(a in backward for a in n.all_input_nodes):
            backward.add(n)
    return [n for n in gm.graph.nodes if n.op == "call_function" and n not in backward]


def _policy(n: torch.fx.Node, mode: str):
    target = n.args[0].target if n.target is operator.getitem and isinstance(n.args[0], torch.fx.Node) else n.target
    tags = getattr(target, "tags", ())
    if torch.Tag.nondeterministic_seeded in tags:
        return CheckpointPolicy.MUST_SAVE
    if mode == "selective" and target in SAVE_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(gm: torch.fx.GraphModule, plan, ctx: PassContext) -> torch.fx.GraphModule:
    modes = {i: l.ac for i, l in enumerate(plan.layers)}
    reshard = plan.fsdp and plan.reshard_after_forward and plan.dp_shard > 1
    tagged: dict[str, int] = {}
    for n in forward_nodes(gm):
        custom = n.meta.get("custom", {})
        if reshard and custom.get("pass") == "fsdp":
            n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            n.meta["ac_graph_id"] = 0
            tagged["reshard"] = tagged.get("reshard", 0) + 1
            continue
        layer = custom.get("layer")
        mode = modes.get(layer, "none") if layer is not None else "none"
        if mode == "none":
            continue
        n.meta["recompute"] = _policy(n, mode)
        n.meta["ac_graph_id"] = layer + 1
        tagged[mode] = tagged.get(mode, 0) + 1
    for k, v in sorted(tagged.items()):
        ctx.note("ac", f"{v} forward nodes tagged {k}" if k != "reshard" else
                 f"{v} parameter-gather nodes recomputed in backward (reshard after forward)")
    gm.recompile()
    return gm
