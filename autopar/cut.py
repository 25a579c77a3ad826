"""The traced step cut into what the planner's analysis reads (``for_analysis``): the first
instance of each distinct repeated layer as a graph of its own (its parameters, then its other
inputs, as placeholders) with what autograd saves in it, and every op outside the layers with
its FLOPs and bytes, before ("pre") or after ("post") them. Nothing here depends on a parallel
configuration."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef

from autopar.capture import StepGraph, layer_signature, layer_signatures_of, vocab_size_of
from autopar.errors import TraceError
from autopar.fxops import (
    VIEW_OPS,
    first_by_storage,
    node_flops,
    op_name,
    tensor_bytes,
    unique_parameters,
)
from autopar.memory import gradient_in_kernel
from autopar.roles import head_feeds_cross_entropy


@dataclass
class OpRecord:
    """One ATen op outside the repeated blocks (embedding, head, loss)."""

    name: str
    segment: str  # "pre" (before the first block) or "post" (after the last)
    flops: int
    bytes: int
    out_shapes: list[tuple[int, ...]]
    in_shapes: list[tuple[int, ...]]
    # Bytes of each output and input (0 for integer tensors, which have no gradient).
    out_bytes: list[int] = field(default_factory=list)
    in_bytes: list[int] = field(default_factory=list)
    # Its backward runs inside Inductor's fused kernels (memory.gradient_in_kernel): compiled,
    # its gradients are never buffers.
    fused_grad: bool = False


@dataclass
class BlockTrace:
    """The ATen FX graph of one distinct block, traced on fake tensors."""

    signature: str
    cls_name: str
    fqns: list[str]  # every instance of this block in the model, in order
    gm: torch.fx.GraphModule
    param_names: list[str]  # placeholder i (of the first len(param_names)) is this parameter
    param_shapes: dict[str, tuple[int, ...]]
    hidden_input_idx: list[int]  # indices (among non-param placeholders) of grad-requiring inputs
    saved_nodes: set[str]  # names of nodes whose output storage autograd saves for backward


@dataclass
class SavedRecord:
    bytes: int
    segment: str
    producer: str
    shape: tuple[int, ...]


@dataclass
class ModelTrace:
    """Everything capture learns about a model, independent of any parallel configuration."""

    name: str
    batch: int
    seq_len: int
    dtype: torch.dtype
    blocks: list[BlockTrace]
    block_container: str  # FQN of the ModuleList holding the repeated blocks
    ops: list[OpRecord]  # outside-block ops (pre/post)
    saved: list[SavedRecord]  # outside-block saved activations
    params: dict[str, tuple[tuple[int, ...], str]]  # every parameter: shape, segment/block
    tied: list[tuple[str, str]]  # parameters shared between two names
    module_types: dict[str, str]
    capture_s: float = 0.0
    fingerprint_src: str = ""
    extras: dict = field(default_factory=dict)
    layers: tuple[str, ...] = ()  # every repeated layer, in the order the model runs them


def _container(layers: list[str]) -> str:
    """The longest module path that holds all of ``layers``."""
    prefix = layers[0].split(".")[:-1] if layers else []
    for name in layers[1:]:
        parts = name.split(".")
        while prefix and parts[: len(prefix)] != prefix:
            prefix = prefix[:-1]
    return ".".join(prefix)


def for_analysis(sg: StepGraph, model: nn.Module, *, name: str, batch: int, seq_len: int, dtype: torch.dtype,
                vocab_size: int | None = None, t0: float | None = None) -> ModelTrace:
    """What the planner's analysis reads, cut from the step graph ``sg`` of ``model``: the graph
    of the first instance of the repeated layers (its parameters, then its other inputs, as
    placeholders) with what autograd saves in it, and every op outside the layers with its FLOPs
    and bytes ("pre" before the first layer, "post" after it)."""
    t0 = time.perf_counter() if t0 is None else t0
    mods = dict(model.named_modules())
    members = [(n, mods[n]) for n in sg.layers]
    vocab_size = vocab_size_of(model, vocab_size)
    gm = sg.gm
    nodes = {n.name: n for n in gm.graph.nodes}
    layer_of = {n.name: n.meta.get("custom", {}).get("layer") for n in gm.graph.nodes}
    phs = sg.placeholders()
    param_nodes = set(phs[: sg.n_params])

    ops: list[OpRecord] = []
    segment = "pre"
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        if layer_of[n.name] is not None:
            segment = "post"
            continue
        op = op_name(n.target)
        if op == "getitem":
            continue
        ins = [a.meta["val"] for a in n.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
        outs = [o for o in pytree.tree_leaves(n.meta.get("val")) if isinstance(o, torch.Tensor)]
        nbytes = 0 if op in VIEW_OPS else sum(map(tensor_bytes, ins + outs))
        grad_bytes = lambda ts: [tensor_bytes(t) if t.is_floating_point() else 0 for t in ts]  # noqa: E731
        ops.append(OpRecord(op, segment, node_flops(n), nbytes,
                            [tuple(o.shape) for o in outs], [tuple(i.shape) for i in ins],
                            grad_bytes(outs), grad_bytes(ins), gradient_in_kernel(n)))
    saved = []
    for node_name, layer, entered in sg.saved:
        node = nodes[node_name]
        if layer is not None or node in param_nodes:
            continue
        v = node.meta["val"]
        saved.append(SavedRecord(v.untyped_storage().nbytes(), "post" if entered else "pre",
                                 "input" if node.op == "placeholder" else op_name(node.target), tuple(v.shape)))

    by_sig: dict[str, list[tuple[str, nn.Module]]] = {}
    for (fqn, m), sig in zip(members, layer_signatures_of([m for _, m in members])):
        by_sig.setdefault(sig, []).append((fqn, m))
    index = {fqn: i for i, fqn in enumerate(sg.layers)}
    blocks = [_layer_graph(sg, index[insts[0][0]], insts) for insts in by_sig.values()]

    block_fqns = {fqn for fqn, _ in members}
    params: dict[str, tuple[tuple[int, ...], str]] = {}
    names, tensors, aliases = unique_parameters(model)
    tied = [(first, other) for first, others in aliases.items() for other in others]
    for pname, p in zip(names, tensors):
        parts = pname.split(".")
        owner = next((b for k in range(1, len(parts)) if (b := ".".join(parts[:k])) in block_fqns), None)
        params[pname] = (tuple(p.shape), owner or "outside")
    module_types = {n: type(m).__name__ for n, m in model.named_modules()}
    fp_src = repr(sorted((k, v[0]) for k, v in params.items())) + repr(sorted(set(module_types.values())))
    return ModelTrace(
        name=name, batch=batch, seq_len=seq_len, dtype=dtype, blocks=blocks,
        block_container=_container(sg.layers), layers=tuple(sg.layers), ops=ops, saved=saved, params=params, tied=tied,
        module_types=module_types, capture_s=time.perf_counter() - t0, fingerprint_src=fp_src,
        # The head's logits split over TP (loss parallelism) only under a cross-entropy, as the
        # executor splits them (roles.head_feeds_cross_entropy); else its "vocabulary" (a DiT's
        # features per patch) is an ordinary width, priced whole.
        extras={"vocab_size": vocab_size, "vocab_split": head_feeds_cross_entropy(sg) if sg.with_loss else True},
    )


def _layer_graph(sg: StepGraph, layer: int, insts: list[tuple[str, nn.Module]]) -> BlockTrace:
    """The nodes of layer ``layer`` of ``sg`` as a graph of their own: a placeholder for each of
    the layer's parameters (in ``named_parameters`` order), then one for each other value it
    reads (the hidden state, rotary tables, masks); ``hidden_input_idx`` marks those computed
    from trained parameters (the residual stream)."""
    fqn, block = insts[0]
    gm = sg.gm
    phs = sg.placeholders()
    by_name = {n: phs[i] for i, n in enumerate(sg.param_names)}
    for first, others in sg.aliases.items():
        by_name.update({o: by_name[first] for o in others})
    names = [n for n, _ in block.named_parameters()]
    shapes = {n: tuple(p.shape) for n, p in block.named_parameters()}
    inside = [n for n in gm.graph.nodes if n.op == "call_function" and n.meta.get("custom", {}).get("layer") == layer]
    if not inside:
        raise TraceError(f"layer {fqn} ({type(block).__name__}) made no operations in the traced step")
    inside_set = set(inside)
    trained = {ph for ph in phs[: sg.n_params] if ph.meta.get("trained")}
    for n in gm.graph.nodes:  # what depends on a trained parameter
        if n.op == "call_function" and any(a in trained for a in n.all_input_nodes):
            trained.add(n)
    g = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for rel in names:
        ph = g.placeholder(rel.replace(".", "_"))
        src = by_name[f"{fqn}.{rel}"]
        ph.meta["val"] = src.meta["val"]
        env.setdefault(src, ph)
    extra: list[torch.fx.Node] = []
    for n in inside:
        for a in n.all_input_nodes:
            if a not in inside_set and a not in env:
                extra.append(a)
                env[a] = None  # placeholder made below, after the parameters
    hidden_idx = []
    for j, a in enumerate(extra):
        if a.op == "get_attr":
            env[a] = g.get_attr(a.target)
        else:
            env[a] = g.placeholder(f"in_{j}_{a.name}")
        env[a].meta = dict(a.meta)
        v = a.meta.get("val")
        if a in trained and isinstance(v, torch.Tensor) and v.is_floating_point():
            hidden_idx.append(j)
    for n in inside:
        env[n] = g.node_copy(n, lambda a: env[a])
    outs = [env[n] for n in inside if any(u not in inside_set for u in n.users)]
    g.output(tuple(outs))
    lgm = torch.fx.GraphModule(gm, g)
    # What autograd saved while this layer ran, as nodes of the new graph (the first holding
    # the storage: a saved view of the layer's input is its placeholder).
    holder = first_by_storage(g.nodes)
    nodes = {n.name: n for n in gm.graph.nodes}
    saved_nodes = set()
    for node_name, lay, _ in sg.saved:
        v = nodes[node_name].meta.get("val")
        if lay == layer and isinstance(v, torch.Tensor):
            ref = StorageWeakRef(v.untyped_storage())
            if ref in holder:
                saved_nodes.add(holder[ref])
    return BlockTrace(
        signature=layer_signature(block), cls_name=type(block).__name__, fqns=[f for f, _ in insts], gm=lgm,
        param_names=names, param_shapes=shapes, hidden_input_idx=hidden_idx, saved_nodes=saved_nodes,
    )

