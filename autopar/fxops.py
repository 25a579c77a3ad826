"""Small helpers over ATen FX graphs that every stage reads: op names, the op sets the stages
agree on, per-node FLOPs and bytes, and which parameters a model registers under several names."""

from __future__ import annotations

import contextlib
import functools
import operator
from typing import Any

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils.flop_counter import flop_registry

_aten = torch.ops.aten

# Layout ops: priced as moving no bytes of their own (a view, or a copy Inductor folds into the
# kernel that reads it).
VIEW_OPS = {
    "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "unsqueeze",
    "squeeze", "slice", "select", "alias", "detach", "as_strided", "unflatten", "flatten",
    "split", "split_with_sizes", "chunk", "unbind", "_reshape_alias", "view_as_real",
    "view_as_complex", "contiguous", "clone", "_to_copy", "to", "lift_fresh_copy",
}

# Ops that keep a projection's features whole while reshaping them (into heads, into parts) or
# copying them: what the role finder follows from a column linear to its consumers.
FEATURE_VIEWS = {_aten.view.default, _aten._unsafe_view.default, _aten.reshape.default, _aten.alias.default,
                 _aten.clone.default, _aten._to_copy.default}
# Ops that split one tensor into parts (a fused QKV or gate/up projection).
# The fused attention kernels a traced step calls: CPU's, and the GPU's flash, efficient and cuDNN.
ATTENTION_OPS = (_aten._scaled_dot_product_flash_attention_for_cpu.default,
                 _aten._scaled_dot_product_flash_attention.default,
                 _aten._scaled_dot_product_efficient_attention.default,
                 _aten._scaled_dot_product_cudnn_attention.default)
SPLIT_OPS = {_aten.split.Tensor, _aten.split_with_sizes.default, _aten.chunk.default, _aten.unsafe_split.Tensor}
# Fresh zeros a value is added onto (a partial sum onto them is still one).
ZEROS = {_aten.zeros.default, _aten.new_zeros.default, _aten.zeros_like.default}
# The collectives the passes insert, by op name: the functional ones (``_c10d_functional``) and
# context parallelism's exchange with the mirror rank (``autopar::mirror_swap``, passes/cp.py).
COLLECTIVES = ("all_gather_into_tensor", "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced",
               "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced", "all_reduce", "all_to_all_single",
               "mirror_swap")


# A node annotation (``custom`` meta): the typical value of the data-dependent size the node
# makes (an unbacked symbol: expert parallelism's routed row counts, at their even share), which
# a liveness walk or a byte count takes for it.
TYPICAL = "typical"


def size_hints(gm: torch.fx.GraphModule) -> dict:
    """The graph's data-dependent sizes (symbols) -> their typical values (``TYPICAL``)."""
    out = {}
    for n in gm.graph.nodes:
        v, typical = n.meta.get("val"), n.meta.get("custom", {}).get(TYPICAL)
        if isinstance(v, torch.SymInt) and typical is not None and v.node.expr.is_Symbol:
            out[v.node.expr] = int(typical)
    return out


def hinted(n: torch.SymInt | int, hints: dict) -> int:
    """``n`` as a number: itself, or a data-dependent size with its symbols at ``hints``."""
    if isinstance(n, int):
        return n
    got = n.node.expr.xreplace(hints)
    if got.free_symbols:
        raise ValueError(f"no typical value for the data-dependent size {n.node.expr}")
    return int(got)


def op_name(target: Any) -> str:
    """'aten.mm.default' -> 'mm'."""
    packet = getattr(target, "overloadpacket", None)
    return getattr(packet, "__name__", None) or getattr(target, "__name__", str(target))


def tensor_bytes(x: Any) -> int:
    return x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0


def op_flops(func: Any, args: tuple, kwargs: dict, out: Any) -> int:
    fn = flop_registry.get(getattr(func, "overloadpacket", None))
    if fn is None:
        return 0
    shapes = pytree.tree_map(lambda x: x.shape if isinstance(x, torch.Tensor) else x, (args, kwargs, out))
    try:
        return int(fn(*shapes[0], **shapes[1], out_val=shapes[2]))
    except Exception:  # a formula that does not accept these arguments: count as no FLOPs
        return 0


def node_flops(n: torch.fx.Node) -> int:
    """``op_flops`` of a traced node, read from its inputs' and output's fake values."""
    args, kwargs = pytree.tree_map_only(torch.fx.Node, lambda a: a.meta.get("val"), (n.args, n.kwargs))
    return op_flops(n.target, args, kwargs, n.meta.get("val"))


@functools.cache
def is_view(target) -> bool:
    """Whether ``target`` returns one tensor aliasing its input (its schema says so, as for
    ``view``, ``t``, ``slice``, ``expand``; ``_unsafe_view`` aliases without saying it)."""
    rets = target._schema.returns if isinstance(target, torch._ops.OpOverload) else ()
    return target is torch.ops.aten._unsafe_view.default or (
        len(rets) == 1 and rets[0].alias_info is not None and not rets[0].alias_info.is_write)


def out_of_place_op(target):
    """An in-place ATen operation's out-of-place form (``add_.Tensor`` -> ``add.Tensor``); any
    other target as it is."""
    if not isinstance(target, torch._ops.OpOverload) or not target._schema.is_mutable:
        return target
    name = target._schema.name.split("::")[-1]
    packet = getattr(torch.ops.aten, name[:-1], None) if name.endswith("_") else None
    return getattr(packet, target._overloadname, target) if packet is not None else target


def _returns_view(op) -> bool:
    returns = getattr(getattr(op, "_schema", None), "returns", ())
    return bool(returns) and returns[0].alias_info is not None


# What makes a tensor of its own, its values not read before a write fills them.
_FRESH = {_aten.new_empty.default, _aten.empty.memory_format, _aten.new_zeros.default, _aten.zeros.default,
          _aten.new_empty_strided.default, _aten.empty_strided.default, _aten.empty_like.default,
          _aten.zeros_like.default, _aten.new_full.default, _aten.full.default}


def _slice_copies(buf: torch.fx.Node, order: dict) -> tuple[list, list[torch.fx.Node]] | None:
    """The ``copy_`` calls that fill slices of ``buf``, each with its chain of slices from
    ``buf``, and ``buf``'s other readers, when those all come after the last copy (no copy's
    result read); else None."""
    writes, readers = [], []
    for u in buf.users:
        chain, x = [], u
        while x.target == _aten.slice.Tensor and x.args[0] is (chain[-1] if chain else buf) and len(x.users) == 1:
            chain.append(x)
            x = next(iter(x.users))
        if chain and x.target == _aten.copy_.default and x.args[0] is chain[-1] and not x.users:
            writes.append((x, chain))
        elif u.users or op_name(u.target) not in VIEW_OPS:  # a view nothing reads reads nothing
            readers.append(u)
    if not writes:
        return None
    last = max(order[c] for c, _ in writes)
    return (sorted(writes, key=lambda w: order[w[0]]), readers) if all(order[r] > last for r in readers) else None


def _scatter_slice_copies(gm: torch.fx.GraphModule) -> None:
    """A tensor the graph makes (``new_empty``) and then fills part by part, ``x[..., :a].copy_(p)``
    and ``x[..., a:].copy_(q)`` (DeepSeek's latent attention in transformers 5 assembles its keys
    so), as ``slice_scatter`` calls, each reading the one before, the readers after the last
    reading the last: the data flow the roles and the sharding rules follow, which a write into a
    view hides."""
    from torch._guards import detect_fake_mode

    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    found = [(buf, *w) for buf in gm.graph.nodes if buf.op == "call_function" and buf.target in _FRESH
             and (w := _slice_copies(buf, order)) is not None]
    if not found:
        return
    g = gm.graph

    def made(target, args, like: torch.fx.Node, **kwargs) -> torch.fx.Node:
        node = g.call_function(target, args, kwargs)
        vals = pytree.tree_map_only(torch.fx.Node, lambda a: a.meta["val"], args)
        node.meta["val"] = target(*vals, **kwargs)
        if "custom" in like.meta:
            node.meta["custom"] = dict(like.meta["custom"])
        return node

    with detect_fake_mode([buf.meta["val"] for buf, _, _ in found]) or contextlib.nullcontext():
        for buf, writes, readers in found:
            cur = buf
            for copy, chain in writes:
                with g.inserting_before(copy):
                    bases = [cur]
                    for sl in chain[:-1]:
                        bases.append(made(_aten.slice.Tensor, (bases[-1], *sl.args[1:]), copy))
                    dst, src = chain[-1].meta["val"], copy.args[1]
                    if src.meta["val"].dtype != dst.dtype:
                        src = made(_aten._to_copy.default, (src,), copy, dtype=dst.dtype)
                    if tuple(src.meta["val"].shape) != tuple(dst.shape):
                        src = made(_aten.expand.default, (src, list(dst.shape)), copy)
                    for sl, base in zip(reversed(chain), reversed(bases)):
                        src = made(_aten.slice_scatter.default, (base, src, *sl.args[1:]), copy)
                    cur = src
                g.erase_node(copy)
                for sl in reversed(chain):
                    g.erase_node(sl)
            for r in readers:
                r.replace_input_with(buf, cur)
    gm.recompile()


def out_of_place(gm: torch.fx.GraphModule, restrides: bool = True) -> None:
    """Rewrite, in ``gm``, each in-place operation whose write only later readers can see as its
    out-of-place form, those readers reading its result (what functionalisation does, without
    tracing the graph again): it writes a tensor the graph made itself (not an input, not a
    constant) that no other value aliases (no view of it, it no view of another), apart from
    the in-place operations on it and views made after its last write, which only read it (a
    router's ``zeros_like(...).scatter_(...)`` then indexed, experts' ``index_add_`` result
    reshaped); so are copies that fill a tensor the graph made slice by slice
    (``_scatter_slice_copies``). Each rewritten node, and each such view, gets a value of its own
    (its storage no longer the written tensor's). Other in-place operations stay."""
    from torch._guards import detect_fake_mode

    _scatter_slice_copies(gm)
    by_storage: dict = {}
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor):
            by_storage.setdefault(StorageWeakRef(v.untyped_storage()), []).append(n)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    ops = {n: out_of_place_op(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    # ``restrides``: a restride in place (as_strided_, t_, unsqueeze_) too, whose out-of-place form
    # is a view (a traced step keeps them: DTensor runs the view form of none).
    found = {n: op for n, op in ops.items() if op is not n.target and (restrides or not _returns_view(op))}
    safe = {}  # write -> (its out-of-place target, what it writes: the tensor and the writes before)
    views: dict = {}  # a view made after the last write on its storage -> that storage's writes
    for n, op in found.items():
        root = n
        while root in found and root.args and isinstance(root.args[0], torch.fx.Node):
            root = root.args[0]
        if root in found or root.op != "call_function" or not isinstance(root.meta.get("val"), torch.Tensor):
            continue  # an input, a constant
        sharers = by_storage.get(StorageWeakRef(root.meta["val"].untyped_storage()), [])
        last = max(order[m] for m in sharers if m in found)
        after = [m for m in sharers if m is not root and m not in found and order[m] > last
                 and m.op == "call_function" and op_name(m.target) in VIEW_OPS]
        if all(m is root or m in found or m in after for m in sharers):
            safe[n] = (op, [m for m in sharers if m is not n and m not in after])
            views.update(dict.fromkeys(after))
    if not safe:
        return
    mode = detect_fake_mode([n.meta["val"] for n in safe])
    with mode if mode is not None else contextlib.nullcontext():
        for n, (op, same) in safe.items():  # in graph order: a later write reads an earlier one's result
            v = n.meta["val"]
            n.target = op
            for m in same:
                for u in list(m.users):
                    if u is not n and order[u] > order[n]:
                        u.replace_input_with(m, n)
            n.meta["val"] = v.new_empty_strided(v.shape, v.stride())
        for m in sorted(views, key=order.__getitem__):  # views of the results: values of the new storage
            args, kwargs = pytree.tree_map_only(torch.fx.Node, lambda a: a.meta["val"], (m.args, m.kwargs))
            m.meta["val"] = m.target(*args, **kwargs)
    gm.recompile()


def mutates(gm: torch.fx.GraphModule) -> bool:
    """Whether ``gm`` may write into a value: an ATen operation that mutates an argument
    (``add_``, ``copy_``, an ``out=`` variant), or any other call that reads a tensor (a
    higher-order operator's body is not looked into); arithmetic on sizes (expert parallelism's
    sums of split sizes) reads none. False: the graph is functional."""
    def writes(n: torch.fx.Node) -> bool:
        if isinstance(n.target, torch._ops.OpOverload):
            return n.target._schema.is_mutable
        return any(not isinstance(a.meta.get("val"), (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool))
                   for a in n.all_input_nodes)

    return any(n.op == "call_function" and n.target is not operator.getitem and writes(n) for n in gm.graph.nodes)


def ancestors(roots) -> set:
    """``roots`` (the nodes among them) and every node they read, transitively."""
    seen, stack = set(), [r for r in roots if isinstance(r, torch.fx.Node)]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        stack += n.all_input_nodes
    return seen


def first_by_storage(nodes) -> dict:
    """Storage -> the name of the first of ``nodes`` whose value lives in it."""
    out: dict = {}
    for n in nodes:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor):
            out.setdefault(StorageWeakRef(v.untyped_storage()), n.name)
    return out


def unique_parameters(model: nn.Module, skip: tuple[str, ...] = ()) -> tuple[list[str], list, dict[str, list[str]]]:
    """Each parameter of ``model`` once, under its first name (``named_parameters`` order), and
    the other names a tied parameter is registered under (a head sharing the embedding's weight):
    ``(names, parameters, {first name: [other names]})``. Names starting with a ``skip`` prefix
    are left out."""
    names, params, aliases, first = [], [], {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if skip and name.startswith(skip):
            continue
        if id(p) in first:
            aliases.setdefault(first[id(p)], []).append(name)
            continue
        first[id(p)] = name
        names.append(name)
        params.append(p)
    return names, params, aliases


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean attention mask (True: attend) as the additive float mask fused attention kernels
    take: 0 where attended, -inf elsewhere."""
    return torch.zeros((), dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))
