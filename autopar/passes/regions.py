"""Each repeated layer compiled once: the layers' compute as calls of shared subgraphs.

The forward and backward graphs hold every layer inlined, so Inductor would compile a 126-layer
model's layer 126 times. This pass cuts each layer's compute into *segments* and replaces every
segment by a call of one subgraph per distinct segment (``torch.ops.higher_order.invoke_subgraph``
with one identifier per subgraph): Inductor compiles each subgraph once and the graph calls it
once per layer, as ``torch.compile`` does for a ``nested_compile_region``. The graphs keep
everything else as it is, in the same order: collectives and their waits, the copies out of
gathered buckets and random draws stay in the outer graph between segments (so the prefetch,
bucketing and reduction placement of ``overlap`` run as scheduled), and so does what the layers
share (rotary tables, masks: values that depend on no parameter).

- **Layers.** A node belongs to the layer its annotation names (``meta["custom"]["layer"]``,
  set while tracing; saved values and recomputed nodes keep theirs). Nodes autograd made for the
  backward carry none: each takes the lowest layer among its inputs' (``_labels``).
- **Segments.** A layer's nodes in graph order, cut where a node reads an outer node that itself
  read the current segment (a TP all-reduce in the middle of the layer): each segment then reads
  only values made before it, and everything that reads it can run after it.
- **Kinds.** Segments with the same operations on the same relative inputs share one subgraph;
  its outputs are every value any of them hands out (the partitioner may save a different value
  of the first layer). A segment that occurs once stays inline.

- **Outputs.** A call hands out no view: a value that is a view, or a copy Inductor may drop, of
  another is returned as that other value and remade outside the call (``_fresh_outputs``).

- **Tails.** An element-wise tail of a layer that only the outer graph's compute reads (a
  gradient's cast to the reduction dtype, the norm before a sequence-parallel gather) stays in
  the outer graph, fused with its reader: inside, the call would return it as a buffer.

The graphs with calls are what Inductor compiles (``StepGraphs.fw_regions``/``bw_regions``); the
flat graphs are rewritten into the order the calls run, each segment's nodes together and
labelled (``meta["segment"]``), and stay what ``memory.py`` walks and ``explain`` lists. Inductor
frees a call's inputs at their last use inside it (its boxed subgraph clears the argument list),
so the walk's rules hold, with one more: a value crossing a call's boundary is a buffer.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autopar.fxops import is_view
from autopar.memory import in_kernel
from autopar.passes import graph_module
from autopar.passes.ac import _draws_random

_INVOKE = torch.ops.higher_order.invoke_subgraph


def regions(graphs, plan, ctx):
    """The pass: ``StepGraphs`` with ``fw_regions``/``bw_regions`` (and, for a split backward,
    ``bw_input_regions``/``bw_weight_regions``) set where a graph has repeated segments."""
    n_params = len(ctx.step.graph.param_names)
    notes = []
    fw_label = _labels(graphs.fw, set())
    fw_dep = _layer_dependent(graphs.fw, n_params, set())
    # The forward's values inside a layer that depend on no parameter: what the layers share (the
    # backward reads them as saved values under the same names).
    shared = {n.name for n in fw_label if n not in fw_dep}
    for attr in ("fw", "bw", "bw_input", "bw_weight"):
        gm = getattr(graphs, attr)
        if gm is None or (attr == "bw" and graphs.bw_input is not None):
            continue
        if attr == "fw":
            out = wrap_layers(gm, fw_label, fw_dep)
        else:
            out = wrap_layers(gm, _labels(gm, shared), _layer_dependent(gm, 0, shared))
        if out is not None:
            wrapped, kinds, calls, ordered = out
            setattr(graphs, attr, ordered)
            setattr(graphs, f"{attr}_regions", wrapped)
            notes.append(f"{attr}: {calls} layer segments as calls of {kinds} compiled subgraphs")
    for line in notes:
        ctx.note("regions", line)
    return graphs


def _layer(n: fx.Node):
    return n.meta.get("custom", {}).get("layer")


def _outer(n: fx.Node) -> bool:
    """Nodes that stay in the outer graph whatever their layer: anything but an ATen call (a
    tuple's item goes with its tuple: ``wrap_layers``), collectives and their waits, the copies
    out of a gathered bucket (``autopar::``), random draws."""
    if n.op != "call_function":
        return True
    if n.target is operator.getitem:
        return False
    if not isinstance(n.target, torch._ops.OpOverload):
        return True
    return n.target.namespace in ("_c10d_functional", "autopar") or _draws_random(n)


def _labels(gm: fx.GraphModule, shared: set[str]) -> dict:
    """Each node's layer: its annotation (forward nodes, the backward's recomputed ones, saved
    values); a node autograd made for the backward (no annotation) takes the lowest layer among
    its inputs': a layer's backward reads its own saved values and the gradient coming from the
    layer above, and hands its gradient down."""
    label = {}
    for n in gm.graph.nodes:
        layer = _layer(n) if n.name not in shared else None
        if layer is not None:
            label[n] = layer
        elif n.op == "call_function" and "custom" not in n.meta:
            below = [label[a] for a in n.all_input_nodes if a in label]
            if below:
                label[n] = min(below)
    return label


def _layer_dependent(gm: fx.GraphModule, n_params: int, shared: set[str]) -> set:
    """Nodes that depend on a parameter (the forward's first ``n_params`` inputs), a tangent or a
    saved value of a layer: what a layer computes of its own. The rest (rotary tables, masks)
    the partitioner may compute once inside the first layer for all of them: it stays outside."""
    dep = set()
    for i, n in enumerate(gm.graph.nodes):
        if n.op == "placeholder":
            if i < n_params or n.name.startswith("tangents") or (_layer(n) is not None and n.name not in shared):
                dep.add(n)
        elif any(a in dep for a in n.all_input_nodes):
            dep.add(n)
    return dep


def _segments(gm: fx.GraphModule, members: dict) -> list[list[fx.Node]]:
    """Each layer's member nodes cut into segments that no outer node both reads and feeds, in
    one walk: ``reads[n]`` holds the open segments ``n`` depends on through a node outside them;
    a member that reads its own open segment that way starts a new one. A layer's segment closes
    after the layer's last member, so the sets stay as small as the layers that overlap."""
    last = {layer: n for n, layer in members.items()}
    segs: list[list[fx.Node]] = []
    seg_of: dict = {}
    open_seg: dict = {}  # layer -> index of its open segment
    reads: dict = {}
    for n in gm.graph.nodes:
        via_outer = set().union(*(reads.get(a, set()) for a in n.all_input_nodes))
        through = via_outer | {seg_of[a] for a in n.all_input_nodes if a in seg_of}
        layer = members.get(n)
        if layer is not None:
            s = open_seg.get(layer)
            if s is None or s in via_outer:
                s = open_seg[layer] = len(segs)
                segs.append([])
            segs[s].append(n)
            seg_of[n] = s
            through.discard(s)
            if last[layer] is n:
                del open_seg[layer]
        through &= set(open_seg.values())
        if through:
            reads[n] = through
    return segs


def _inputs(seg: list[fx.Node]) -> list[fx.Node]:
    """What a segment reads from outside it, in order of first use."""
    inside, ins = set(seg), {}
    for n in seg:
        for a in n.all_input_nodes:
            if a not in inside:
                ins.setdefault(a, None)
    return list(ins)


def _key(seg: list[fx.Node], ins: list[fx.Node]) -> tuple:
    """The segment's operations on its relative inputs (which of its inputs, which of its nodes).
    A segment sized by its data (expert parallelism's routed rows: unbacked sizes of its own in
    every layer) has a key of its own: it stays inline."""
    idx = {x: ("in", i) for i, x in enumerate(ins)} | {n: ("n", j) for j, n in enumerate(seg)}
    if any(isinstance(n.meta.get("val"), torch.SymInt) or (isinstance(n.meta.get("val"), torch.Tensor) and any(
            not isinstance(d, int) for d in n.meta["val"].shape)) for n in (*seg, *ins)):
        return ("data-dependent", seg[0].name)

    def shape(v):  # and dtype: two layers in different precisions share no code
        return (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None

    return tuple((str(n.target), repr(fx.node.map_arg((n.args, n.kwargs), lambda x: idx[x])), shape(n.meta.get("val")))
                 for n in seg) + tuple(shape(a.meta.get("val")) for a in ins)


def wrap_layers(gm: fx.GraphModule, label: dict, dep: set) -> tuple | None:
    """``gm`` rebuilt with each repeated layer segment a call of its kind's subgraph: (graph,
    kinds, calls, the flat graph in the calls' order: ``_rebuild``), or None when no segment
    repeats. ``label``: each node's layer (``_labels``); ``dep``: the nodes a layer computes of
    its own (``_layer_dependent``)."""
    members = {}
    for n in gm.graph.nodes:  # in order: an item of an outer node's tuple stays outer with it
        if n in label and n in dep and not _outer(n) and (n.target is not operator.getitem or n.args[0] in members):
            members[n] = label[n]
    # An element-wise tail that only the outer graph's compute reads (a gradient's cast to the
    # reduction's dtype, which Inductor writes straight into the flat reduce bucket; the norm
    # before a sequence-parallel gather) stays outside with its reader: inside, the call would
    # return it as a buffer of its own. A value the graph returns is a buffer either way.
    for n in reversed(list(members)):
        if in_kernel(n) and n.users and not any(u in members or u.op == "output" for u in n.users):
            del members[n]
    segs = [(s, _inputs(s)) for s in _segments(gm, members)]
    keys = [_key(s, ins) for s, ins in segs]
    count: dict = {}
    for k in keys:
        count[k] = count.get(k, 0) + 1
    wrapped = [(s, ins, k) for (s, ins), k in zip(segs, keys) if count[k] > 1]
    if not wrapped:
        return None
    outs: dict = {}
    for s, _, k in wrapped:
        inside = set(s)
        outs.setdefault(k, set()).update(j for j, n in enumerate(s) if any(u not in inside for u in n.users))
    views: dict = {}
    for s, _, k in wrapped:
        if k not in views:
            outs[k], views[k] = _fresh_outputs(s, outs[k])
    wrapped = [w for w in wrapped if outs[w[2]]]  # a segment that only views its inputs stays inline
    if not wrapped:
        return None
    return _rebuild(gm, wrapped, outs, views)


def _source(n: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
    """What ``n``'s value may be a view of once Inductor lowers it, and the nodes between (``n``
    first): its input for a view (``t``, ``detach``, an item of ``split`` with the ``split``) or
    for an operation Inductor drops as a no-op (``_dropped``); None for anything else."""
    if n.op != "call_function":
        return None
    if n.target is operator.getitem:
        lst = n.args[0]
        rets = getattr(lst.target, "_schema", None) and lst.target._schema.returns
        if lst.op == "call_function" and rets and rets[0].alias_info is not None and isinstance(lst.args[0], fx.Node):
            return lst.args[0], [n, lst]
        return None
    if not isinstance(n.target, torch._ops.OpOverload):
        return None
    ins = n.all_input_nodes
    if is_view(n.target):
        return (ins[0], [n]) if len(ins) == 1 else None
    src = _dropped(n)
    return (src, [n]) if src is not None else None


def _dropped(n: fx.Node) -> fx.Node | None:
    """The input Inductor reads in place of ``n`` where its ``remove_noop_ops`` drops ``n``, by
    its own rule (``clone(x)``, ``x ** 1``, a one-piece ``cat``, a cast to the same dtype: each
    only where the value is laid out as the input's); None where ``n`` writes a buffer of its
    own (a cast to another dtype, a copy of an expanded view into whole rows: grouped-query
    attention's repeated keys, ``x ** 3``), which the call hands out as it is. Handing out the
    input instead would replay that work outside the call, or return (and hold) the wider value
    of a cast, e.g. the fp32 rotary query saved in bf16."""
    from torch._inductor.fx_passes.post_grad import noop_registry, same_meta
    from torch._inductor.fx_utils import get_fake_args_kwargs

    if n.target not in noop_registry:
        return None
    cond, src_index = noop_registry[n.target]
    src = n.args[src_index] if isinstance(src_index, int) else src_index(n.args)
    if not isinstance(src, fx.Node) or not same_meta(n, src):
        return None
    ok, args, kwargs = get_fake_args_kwargs(n)
    return src if ok and cond(*args, **kwargs) else None


def _fresh_outputs(seg: list[fx.Node], outs: set[int]) -> tuple[list[int], list[list[int]]]:
    """A kind's outputs with none that Inductor could return as a view. The outer graph takes
    what a call returns for a buffer of its own: a returned view of an input lets it reuse that
    input's memory while the view still reads it, and a returned view into the call's own buffer
    at an offset is read at that offset twice (torch 2.13's ``InvokeSubgraph`` keeps the offset in
    the output's layout; a split's second half reads past its buffer's end). So each output that
    is a view or a pass-through of another value is returned as that value (a node of the segment
    that is neither), or not at all for a view of an input, and the nodes between are replayed
    outside the call. Returns (outputs, chains: the replayed nodes' indices, the handed-out one
    first)."""
    idx = {n: j for j, n in enumerate(seg)}
    direct, chains = set(), []
    for j in sorted(outs):
        chain, n = [], seg[j]
        while n in idx and (src := _source(n)) is not None:
            chain += [idx[m] for m in src[1] if m in idx]
            n = src[0]
        if chain:
            chains.append(chain)
        if n in idx:
            direct.add(idx[n])
    return sorted(direct), chains


def _subgraph(seg: list[fx.Node], ins: list[fx.Node], outs: list[int]) -> fx.Graph:
    g, env = fx.Graph(), {}
    for i, a in enumerate(ins):
        ph = g.placeholder(f"arg{i}")
        ph.meta = dict(a.meta)
        env[a] = ph
    for n in seg:
        env[n] = g.node_copy(n, lambda x: env[x])
    g.output(tuple(env[seg[j]] for j in outs))
    return g


def _rebuild(gm: fx.GraphModule, wrapped: list, outs: dict, views: dict) -> tuple | None:
    """The new graphs: the original nodes in order, each wrapped segment emitted as one call where
    its first node was, or as soon after as what it reads is made; a node that reads a segment
    not emitted yet waits until it is. (At its last node, a layer whose saved values the
    partitioner detaches at the end of the forward would run after every later layer's gathers.)
    Returns (graph with calls, kinds, calls, flat graph): the flat graph holds the same nodes in
    the order the calls run them, each segment's nodes together and labelled
    ``meta["segment"]`` and, where the call returns it, ``meta["segment_out"]`` (what ``memory.py``
    walks: a value the call returns is a buffer until the call ends, never a fused kernel's
    register; a kind returns what any of its segments hands out). The subgraphs become
    submodules of the graph with calls."""
    names: dict = {}
    first = {s[0]: i for i, (s, _, _) in enumerate(wrapped)}
    inside = {n for s, _, _ in wrapped for n in s}
    items = [("seg", first[n]) if n in first else ("node", n) for n in gm.graph.nodes if n in first or n not in inside]
    g, env = fx.Graph(), {}
    flat, flat_env = fx.Graph(), {}

    def ready(item) -> bool:
        return all(a in env for a in (wrapped[item[1]][1] if item[0] == "seg" else item[1].all_input_nodes))

    def emit(item) -> None:
        if item[0] == "node":
            env[item[1]] = g.node_copy(item[1], lambda x: env[x])
            flat_env[item[1]] = flat.node_copy(item[1], lambda x: flat_env[x])
            return
        s, ins, k = wrapped[item[1]]
        outside = {j for chain in views[k] for j in chain}  # replayed after the call
        for j, n in enumerate(s):
            flat_env[n] = flat.node_copy(n, lambda x: flat_env[x])
            if j not in outside:
                flat_env[n].meta = {**n.meta, "segment": item[1], "segment_out": j in outs[k]}
        if k not in names:
            names[k] = f"_layer_segment_{len(names)}"
            gm.add_submodule(names[k], graph_module(gm, _subgraph(s, ins, outs[k])))
        call = g.call_function(_INVOKE, (g.get_attr(names[k]), names[k], *[env[a] for a in ins]))
        call.meta["val"] = tuple(s[j].meta.get("val") for j in outs[k])
        for i, j in enumerate(outs[k]):
            env[s[j]] = g.call_function(operator.getitem, (call, i))
            env[s[j]].meta = dict(s[j].meta)
        for chain in views[k]:
            for j in reversed(chain):
                if s[j] not in env:
                    env[s[j]] = g.node_copy(s[j], lambda x: env[x])

    pending: list = []
    for item in items:
        pending.append(item)
        while (p := next((p for p in pending if ready(p)), None)) is not None:
            emit(p)
            pending.remove(p)
    if pending:
        return None  # a segment that reads itself through the outer graph: leave the graph flat
    new, ordered = graph_module(gm, g), graph_module(gm, flat)
    new.graph.lint()
    ordered.graph.lint()
    return new, len(names), len(wrapped), ordered
