"""Activation checkpointing and ZeRO-3 resharding as recompute tags on the joint graph.

For every forward node of a layer whose plan says ``full``, ``node.meta["recompute"]`` is
``PREFER_RECOMPUTE``; under ``selective`` the outputs of matmuls and attention kernels are
``MUST_SAVE`` and the rest ``PREFER_RECOMPUTE`` (op-level selective AC). ``ac_graph_id`` is the
layer, so each layer is its own region. Ops that draw random numbers (tagged
``nondeterministic_seeded`` with a nonzero dropout probability) are always saved: recomputing
them would not reproduce their output. Attention kernels without dropout are tagged so too but
draw nothing: under ``full`` they become ``unseeded`` copies and recompute like the rest, so full
AC keeps only each layer's input, as ``torch.utils.checkpoint`` and Megatron-LM's full recompute do.
When the plan reshards after forward (ZeRO-3), each parameter's gather is ``MUST_RECOMPUTE``:
the backward gathers it again instead of keeping it. The min-cut partitioner (``backend``)
honours the tags, as it does for ``torch.utils.checkpoint`` regions.
"""

from __future__ import annotations

import operator

import torch
from torch.utils.checkpoint import CheckpointPolicy

from autopar.fxops import COLLECTIVES, VIEW_OPS, op_name
from autopar.passes import GATHERED_INPUT, PassContext
from autopar.passes.cp import KV_GATHERED
from autopar.passes.ep import WEIGHTS as EP_WEIGHTS

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


def _seeded(target) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(target, "tags", ())


def _draws_random(op_node: torch.fx.Node) -> bool:
    """An op tagged ``nondeterministic_seeded`` draws random numbers unless its probability
    argument (attention's ``dropout_p``, dropout's ``p``) is 0: then it is deterministic, and
    recomputing it gives the same output (attention without dropout recomputes under full AC,
    as in ``torch.utils.checkpoint``)."""
    target = op_node.target
    if not _seeded(target):
        return False
    for i, arg in enumerate(target._schema.arguments):
        if arg.name in ("dropout_p", "p"):
            value = op_node.kwargs.get(arg.name, op_node.args[i] if i < len(op_node.args) else arg.default_value)
            return not (isinstance(value, (int, float)) and value == 0)
    return True


_LIB: list = []
_UNSEEDED: dict = {}


def unseeded(op: torch._ops.OpOverload) -> torch._ops.OpOverload:
    """``op`` as an ``autopar::`` operator with the same schema and kernel but without the
    ``nondeterministic_seeded`` tag, for a call that draws nothing (attention with no dropout):
    the min-cut partitioner then recomputes it like any other op instead of threading an RNG
    state from forward to backward for a call that draws nothing."""
    if op not in _UNSEEDED:
        if not _LIB:
            _LIB.append(torch.library.Library("autopar", "FRAGMENT"))
        lib = _LIB[0]
        name = f"unseeded_{op._schema.name.split('::')[-1]}_{op._overloadname}"
        schema = str(op._schema).split("::", 1)[1]
        lib.define(name + schema[schema.index("("):])
        lib.impl(name, lambda *args, **kwargs: op(*args, **kwargs), "CompositeExplicitAutograd")
        _UNSEEDED[op] = getattr(torch.ops.autopar, name).default
    return _UNSEEDED[op]


def unseeded_sources(targets) -> list[str]:
    """The operators (``namespace.name.overload``) whose ``unseeded`` copies are among ``targets``:
    what a process that loads graphs holding such copies defines first (``passes/shared.py``)."""
    source = {v: k for k, v in _UNSEEDED.items()}
    return sorted(f"{source[t].namespace}.{source[t]._schema.name.split('::')[-1]}.{source[t]._overloadname}"
                  for t in set(targets) if t in source)


def define_unseeded(sources: list[str]) -> None:
    """``unseeded`` of each operator named as ``unseeded_sources`` names it."""
    for qual in sources:
        ns, name, overload = qual.split(".")
        unseeded(getattr(getattr(getattr(torch.ops, ns), name), overload))


def recompute_policy(n: torch.fx.Node, mode: str):
    """The checkpoint policy of forward node ``n`` of a layer under AC ``mode`` (None: untagged)."""
    op_node = n.args[0] if n.target is operator.getitem and isinstance(n.args[0], torch.fx.Node) else n
    target = op_node.target
    if op_node.op == "call_function" and _draws_random(op_node):
        return CheckpointPolicy.MUST_SAVE
    if mode == "selective" and target in SAVE_OPS:
        return None  # never recomputed (the partitioner bans compute-intensive ops), saved if read
    if mode == "selective" and _is_collective(target) and n.meta.get("custom", {}).get("why") != GATHERED_INPUT:
        return CheckpointPolicy.MUST_SAVE  # a reduction's output, not the collective again
    return CheckpointPolicy.PREFER_RECOMPUTE


def _is_collective(target) -> bool:
    return isinstance(target, torch._ops.OpOverload) and (target.namespace == "_c10d_functional"
                                                          or op_name(target) in COLLECTIVES)


def _views_regathered(n: torch.fx.Node, gathered: set) -> bool:
    """``n`` is a view (or a piece of one) of a parameter gathered again in the backward."""
    return (n.op == "call_function" and (op_name(n.target) in VIEW_OPS or n.target is operator.getitem)
            and bool(n.all_input_nodes) and all(a in gathered for a in n.all_input_nodes))


def apply_ac(gm: torch.fx.GraphModule, plan, ctx: PassContext) -> torch.fx.GraphModule:
    modes = {i: l.ac for i, l in enumerate(plan.layers)}
    reshard = plan.fsdp and plan.reshard_after_forward and plan.dp_shard * plan.cp > 1
    tagged: dict[str, int] = {}
    gathered: set = set()  # the gathers tagged so far, and their views
    for n in forward_nodes(gm):
        custom = n.meta.get("custom", {})
        # Reshard after forward: the backward gathers each parameter again. Context parallelism:
        # the backward gathers the whole sequence's keys and values again (each rank keeps its own).
        # Expert parallelism: the backward reads the rank's own experts' weights again likewise.
        regather = custom.get("pass") == "fsdp" or (custom.get("why") == EP_WEIGHTS and custom.get("pass") == "ep")
        again = "reshard" if reshard and regather else "cp" if custom.get("why") == KV_GATHERED else None
        if again is None and reshard and _views_regathered(n, gathered):
            again = "reshard"  # a gathered weight's views (a 3-D expert weight's experts): saved, they would keep it
        if again:
            n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            n.meta["ac_graph_id"] = 0
            tagged[again] = tagged.get(again, 0) + 1
            if again == "reshard":
                gathered.add(n)
            continue
        layer = custom.get("layer")
        mode = modes.get(layer, "none") if layer is not None else "none"
        if mode == "none":
            continue
        if mode == "full" and _seeded(n.target) and not _draws_random(n):
            n.target = unseeded(n.target)  # deterministic here: recomputed in backward, as the rest
        policy = recompute_policy(n, mode)
        if policy is None:
            continue
        n.meta["recompute"] = policy
        n.meta["ac_graph_id"] = layer + 1
        tagged[mode] = tagged.get(mode, 0) + 1
    for k, v in sorted(tagged.items()):
        ctx.note("ac", {"reshard": f"{v} parameter-gather nodes recomputed in backward (reshard after forward)",
                        "cp": f"{v} key/value-gather nodes recomputed in backward (context parallelism)"}.get(
                            k, f"{v} forward nodes tagged {k}"))
    gm.recompile()
    return gm
