"""Where the data-parallel collectives run: per-layer buckets, gathered just before use and
prefetched a bounded number of layers ahead, gradients reduced as soon as they are complete.

Runs on the partitioned forward and backward graphs, before Inductor (which, on this build,
keeps the order it is given: ``backend.compile_graph`` turns its peak-memory reordering off so
the order chosen here is the order that runs, and the order ``memory.py`` prices).

- **Gathers** (FSDP's parameter all-gathers; ``distribute`` records each where its parameter is
  first used, and the partitioner puts ZeRO-3's backward regathers before their first use):
  consecutive gathers of one layer's parameters (or of parameters outside the layers) become one
  bucket, a single all-gather of one flat buffer (Inductor's ``merge_all_gather_bucket``), whose
  wait sits just before the first use of any of its parameters. Then each bucket's all-gather is
  issued ``prefetch`` buckets ahead: just before the wait of the bucket ``prefetch`` places
  earlier, placed after that bucket's parameters are copied out of its flat buffer, so it runs
  while that layer computes. With ``prefetch = 1`` (FSDP2's default) at most two layers'
  gathered weights are alive at once, plus whatever the plan keeps for the backward.
- **Gradient reductions** (reduce-scatters, and the all-reduces of DDP/HSDP, on the data-parallel
  groups only; TP's collectives are never touched): one bucket per layer, issued where the
  layer's last gradient is complete (autograd completes a layer's gradients together), waited
  just before the next bucket of the same kind is issued or the result is used.

A bucket never mixes layers, so the count matches what the cost model prices (one all-gather and
one reduce-scatter per layer and pass).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_c10d = torch.ops._c10d_functional
_WAIT = _c10d.wait_tensor.default
_GATHER = _c10d.all_gather_into_tensor.default
_REDUCE = {_c10d.reduce_scatter_tensor.default: "reduce_scatter", _c10d.all_reduce.default: "all_reduce"}


# A node meta key: the data-parallel pass a gradient reduction belongs to. Not in ``custom``,
# whose absence marks a node autograd made for the backward (``regions`` labels those by input).
DP_PASS = "autopar_dp_pass"


@dataclass
class DPCollectives:
    """What ``overlap`` needs to know of a step's data-parallel collectives."""

    param_layer: list  # parameter index -> its repeated layer (None outside the layers)
    grad_param: list  # backward output -> the parameter whose gradient it is (None otherwise)
    groups: set  # names of the data-parallel process groups


@dataclass
class Bucket:
    kind: str  # all_gather | reduce_scatter | all_reduce
    key: tuple  # (layer or None, group, dtype, ...): consecutive collectives with one key merge
    nodes: list  # the collective nodes, in graph order


def overlap(graphs, plan, ctx):
    """The pass: ``schedule`` on the forward graph (gathers) and the backward graph (regathers
    and gradient reductions) of a ``StepGraphs``, ``ctx.step.dp`` saying which collectives are
    data-parallel; ``plan.fsdp_prefetch`` buckets gathered ahead; the user's ``bucket`` switch
    off keeps one collective per parameter."""
    dp = ctx.step.dp
    kw = dict(param_layer=dp.param_layer, dp_groups=dp.groups, prefetch=plan.fsdp_prefetch,
              merge="bucket" not in ctx.disabled)
    schedule(graphs.fw, grad_param=[], **kw)
    schedule(graphs.bw, grad_param=dp.grad_param, **kw)
    return graphs


def schedule(gm: torch.fx.GraphModule, *, param_layer: list, grad_param: list, dp_groups: set[str],
             prefetch: int = 1, merge: bool = True) -> torch.fx.GraphModule:
    """Bucket, place and prefetch ``gm``'s data-parallel collectives (in place).

    ``param_layer[i]``: the repeated layer parameter ``i`` belongs to (None outside the layers);
    ``grad_param[j]``: the parameter whose gradient is the graph's output ``j`` (None for other
    outputs); ``dp_groups``: the names of the data-parallel process groups; ``merge=False`` keeps
    one collective per parameter (placement and prefetch still apply)."""
    one_wait_each(gm)
    g = gm.graph
    gathers = _buckets(g, "all_gather", lambda n: _gathered_param(n, dp_groups), param_layer, merge)
    starts = [_merge_gather(g, b) for b in gathers]
    _prefetch(g, starts, prefetch)
    out_param = _output_params(g, grad_param)
    for kind in ("reduce_scatter", "all_reduce"):
        reduces = _buckets(g, kind, lambda n: _reduced_param(n, dp_groups, out_param), param_layer, merge)
        merged = [_merge_reduce(g, b) for b in reduces]
        for _, tail in merged:  # for explain (``collective_record``): backward nodes carry no annotation
            (n,) = tail[0].all_input_nodes
            n.meta[DP_PASS] = "fsdp" if kind == "reduce_scatter" else "ddp"
        _place_reduce_waits(g, merged)
    g.lint()
    gm.recompile()
    return gm


def one_wait_each(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """Each collective waited once, as Inductor's bucketing requires. Two parameters whose
    gradients are one computation (GPT-NeoX's parallel attention and MLP output biases: both the
    sum of the same residual gradient) get one collective from common-subexpression elimination,
    waited twice; the later wait's users take the first's result (the same tensor)."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in list(gm.graph.nodes):
        waits = sorted((u for u in n.users if u.op == "call_function" and u.target is _WAIT), key=order.get)
        for w in waits[1:]:
            w.replace_all_uses_with(waits[0])
            gm.graph.erase_node(w)
    return gm


# -- finding the collectives -----------------------------------------------------------------
def _group(n: torch.fx.Node) -> str:
    try:
        from torch._inductor.fx_passes.bucketing import _resolve_group_name
    except ImportError:  # torch 2.11: the node carries the group's name itself
        return str(n.args[-1])
    return str(_resolve_group_name(n.args[-1]))


def _wait_of(n: torch.fx.Node) -> torch.fx.Node | None:
    users = list(n.users)
    return users[0] if len(users) == 1 and users[0].target is _WAIT else None


def _gathered_param(n: torch.fx.Node, dp_groups: set[str]) -> int | None:
    """The parameter an FSDP all-gather gathers (``distribute`` annotates it), or None."""
    if n.op != "call_function" or n.target is not _GATHER or _group(n) not in dp_groups or _wait_of(n) is None:
        return None
    return n.meta.get("custom", {}).get("param_index")


def _output_params(g: torch.fx.Graph, grad_param: list) -> dict:
    """Output node argument -> the parameter whose gradient it is."""
    (out,) = g.find_nodes(op="output")
    args = out.args[0] if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    found: dict = {}
    for a, p in zip(args, grad_param):
        if isinstance(a, torch.fx.Node) and p is not None:
            found.setdefault(a, p)
    return found


def _reduced_param(n: torch.fx.Node, dp_groups: set[str], out_param: dict) -> int | None:
    """The parameter whose gradient a data-parallel reduction reduces: its result flows, through
    single-input ops only, to that gradient's output. None for any other collective."""
    if n.op != "call_function" or n.target not in _REDUCE or _group(n) not in dp_groups:
        return None
    node = _wait_of(n)
    while node is not None:
        if node in out_param:
            return out_param[node]
        users = list(node.users)
        if len(users) != 1 or users[0].op == "output" or len(users[0].all_input_nodes) != 1:
            return None
        node = users[0]
    return None


def _buckets(g: torch.fx.Graph, kind: str, param_of, param_layer: list, merge: bool) -> list[Bucket]:
    """Consecutive collectives of ``kind`` with the same layer, group and dtype, in graph order."""
    out: list[Bucket] = []
    for n in g.nodes:
        p = param_of(n)
        if p is None or (kind == "all_gather") != (n.target is _GATHER) or \
                (kind != "all_gather" and _REDUCE.get(n.target) != kind):
            continue
        key = (param_layer[p], _group(n), n.meta["val"].dtype, tuple(a for a in n.args[1:-1] if isinstance(a, str)))
        if merge and out and out[-1].key == key:
            out[-1].nodes.append(n)
        else:
            out.append(Bucket(kind, key, [n]))
    return out


# -- moving nodes ------------------------------------------------------------------------------
def _order(g: torch.fx.Graph) -> dict:
    return {n: i for i, n in enumerate(g.nodes)}


def _ancestors_after(nodes: list, target: torch.fx.Node, order: dict) -> list:
    """``nodes`` and every ancestor of them that sits at or after ``target``, in graph order."""
    seen, stack = set(), list(nodes)
    while stack:
        n = stack.pop()
        if n in seen or n.op == "placeholder" or order[n] < order[target]:
            continue
        seen.add(n)
        stack += n.all_input_nodes
    return sorted(seen, key=order.get)


def _hoist(g: torch.fx.Graph, nodes: list, target: torch.fx.Node) -> None:
    """Move ``nodes`` and what they need to just before ``target`` (pure ops: values unchanged)."""
    for n in _ancestors_after(nodes, target, _order(g)):
        if n is not target:
            target.prepend(n)


def _first_user(nodes: list, order: dict, exclude: set = frozenset()) -> torch.fx.Node | None:
    users = [u for n in nodes for u in n.users if u not in exclude]
    return min(users, key=order.get) if users else None


# -- gathers ---------------------------------------------------------------------------------
def _merge_gather(g: torch.fx.Graph, b: Bucket) -> tuple[torch.fx.Node, torch.fx.Node]:
    """One all-gather for the bucket, waited (and its parameters copied out of the flat buffer)
    just before its first use. Returns (the gather, that first use)."""
    order = _order(g)
    waits = [_wait_of(n) for n in b.nodes]
    use = _first_user(waits, order)
    if len(b.nodes) == 1:
        ag, w = b.nodes[0], waits[0]
        if use is not None and order[w] < order[use] - 1:
            use.prepend(w)
        return ag, use
    from torch._inductor.fx_passes.bucketing import process_collective_bucket

    _hoist(g, [n.args[0] for n in b.nodes], use)
    _, size, group = b.nodes[0].args
    # The gathered dtype: Inductor's bucketing hands ``_gather_flat`` a cast's input in place of
    # the cast (mixed precision casts each shard before its gather), so the cast is redone there.
    dtype = b.nodes[0].meta["val"].dtype
    new, _ = process_collective_bucket(
        g, b.nodes, _gather_flat, lambda ins: ([i.meta["val"] for i in ins], group, size, dtype), insert_before=use)
    return next(n for n in new if n.target is _GATHER), use


def _gather_flat(ins: list, group: str, size: int, dtype: torch.dtype) -> list:
    """The bucket's gather, traced into the graph: the shards concatenated, one out-of-place
    all-gather, each parameter copied out of the flat buffer at once (``copy_out``), so the flat
    buffer is freed there. Out of place, because Inductor keeps an out-of-place collective's
    input alive until its wait, which it does not do for the input of
    ``all_gather_into_tensor_out`` (with a prefetched gather in flight, it reused that buffer).
    Not the coalesced all-gather, whose outputs would need no copy: compiled by Inductor it left
    every layer's gathered weights resident (measured with bench/memory.py: twice FSDP2's step
    peak at 8 and 16 layers, where the liveness of the same graphs is FSDP2's)."""
    flat = torch.cat([x.reshape(-1).to(dtype) for x in ins])
    out = _WAIT(_GATHER(flat, size, group)).reshape(size, -1)
    parts = torch.ops.autopar.copy_out(out, [x.numel() for x in ins])
    return [p.view((x.shape[0] * size, *x.shape[1:])) for p, x in zip(parts, ins)]


@torch.library.custom_op("autopar::copy_out", mutates_args=())
def copy_out(gathered: torch.Tensor, numels: list[int]) -> list[torch.Tensor]:
    """Each parameter's block ``(ranks, numel)`` of a gathered flat buffer ``(ranks, total)``,
    copied out contiguous, all in one op (FSDP2's all-gather copy-out). One opaque op, because
    Inductor would otherwise fuse each parameter's copy (or a small parameter's read) into the
    kernel that uses it, and a norm weight read by the next layer's first fused kernel kept the
    whole flat buffer alive across the next gather: three layers' weights at once."""
    return list(torch.split_with_sizes_copy(gathered, numels, dim=1))


@copy_out.register_fake
def _(gathered: torch.Tensor, numels: list[int]) -> list[torch.Tensor]:
    return [gathered.new_empty((gathered.shape[0], n)) for n in numels]


def _prefetch(g: torch.fx.Graph, buckets: list[tuple[torch.fx.Node, torch.fx.Node]], depth: int) -> None:
    """Issue bucket k's all-gather where bucket k - depth starts being used: after that bucket's
    parameters are copied out of its flat buffer (freed then), before its layer computes. With
    depth 1 a rank then holds one layer's parameters and the next one's flat buffer, as FSDP2."""
    if depth < 1:
        return
    for k in range(depth, len(buckets)):
        ag, target = buckets[k][0], buckets[k - depth][1]
        order = _order(g)
        if order[ag] > order[target]:
            _hoist(g, [ag], target)


# -- gradient reductions ---------------------------------------------------------------------
def _merge_reduce(g: torch.fx.Graph, b: Bucket) -> tuple[torch.fx.Node, list]:
    """One reduction for the bucket, issued where its last input is ready. Returns (the first
    node of the bucket's reduction: its input's concatenation, or the collective itself; the
    nodes from its wait on, which ``_place_reduce_waits`` moves)."""
    if len(b.nodes) == 1:
        return b.nodes[0], [_wait_of(b.nodes[0])]
    from torch._inductor.fx_passes import bucketing as bk

    # Over one flat buffer, not coalesced: see _gather_flat.
    merge = bk.merge_reduce_scatter_bucket if b.kind == "reduce_scatter" else bk.merge_all_reduce_bucket
    new, _ = merge(g, b.nodes)
    i = next(i for i, n in enumerate(new) if n.target is _WAIT)
    return new[0], new[i:]


def _place_reduce_waits(g: torch.fx.Graph, buckets: list[tuple[torch.fx.Node, list]]) -> None:
    """Wait for bucket k's reduction just before bucket k + 1's starts (its gradients copied into
    one buffer), or where its result is used, or at the graph's end: the reduction runs while the
    next layer's backward computes, and at most one bucket's flat gradients wait in flight."""
    (out,) = g.find_nodes(op="output")
    for k, (_, tail) in enumerate(buckets):
        order = _order(g)
        cands = [out] + ([buckets[k + 1][0]] if k + 1 < len(buckets) else [])
        use = _first_user(tail, order, exclude=set(tail))
        if use is not None:
            cands.append(use)
        target = min(cands, key=order.get)
        if order[tail[-1]] < order[target]:
            for n in tail:
                target.prepend(n)
