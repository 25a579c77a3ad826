"""Each run of identical layers replayed once: the joint graph's other copies stamped from it.

The distribute pass replays the single-device step graph under ``make_fx`` and takes autograd's
gradients through it, one dispatch per operation of every layer: at depth the largest part of
the time to the first step (HF Llama, 32 layers: 3.6 s of 17). Where the step graph shows a
*run* of layers that are the same computation, each reading what the layer before it made,
the replay holds the run's first two layers only (``reduced``): the first (which reads what the
layers before the run made) and the *template* (which reads a layer's output, as every later one
does). The joint graph of that replay is then widened (``expand``): each later layer's forward
is the template's forward nodes copied after it, and its backward the template's backward nodes
copied before it, reading its own parameters, what the layer before it made and the gradient
the layer above it hands down. The result is the graph a replay of every layer makes, in the
same order (``tests/test_stamp.py`` compares the two node for node).

What makes a run (``find_runs``), read from the step graph, nothing assumed of the model (a
"layer" below is one layer, or a block of 2, 3, 4 or 6 consecutive layers where the model's
layers come in kinds that take turns, Gemma 2's local and global attention):
- each layer's nodes are contiguous, and nothing lies between the run's layers;
- the layers after the first are the same operations on the same relative inputs (shapes,
  strides, dtypes), each reading its own parameters (read by no other node), the same shared
  values (rotary tables, masks: none trained) and the values of the layer just before it at the
  same places; nothing but the next layer reads a layer's values (the last one's: anything after).

What the plan must do alike (``alike``): place each copy's parameters as the template's (TP and
data-parallel placement, local shape), and name the same places in each layer in its TP rules.

What the replay must show before the copies are trusted (``expand``, else the full replay runs):
what the template reads of the first layer and what it hands on have the same local shapes,
strides, dtypes and placements on the mesh, and so do the gradients coming back into them; every
node of the template's forward and backward reads only the template's own nodes, its parameters,
what the first layer handed it, the gradients coming into its outputs and values made before
the run. Not used under expert parallelism, where each layer's routed rows are sized when the
step runs (``distribute.build_joint``; a replay showing such sizes elsewhere: ``_stamped``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.multiprocessing.reductions import StorageWeakRef

from autopar.fxops import ancestors

log = logging.getLogger(__name__)


class NotStampable(Exception):
    """The replay of a reduced step does not show what a stamped copy needs; replay every layer."""


def checking() -> bool:
    """``AUTOPAR_STAMP=check``: every stamped joint compared with the replay of every layer (tests)."""
    return os.environ.get("AUTOPAR_STAMP") == "check"


@dataclass
class Run:
    """Blocks ``first``, ``template``, then ``copies``, each of one layer or of a period of
    layers that repeats (Gemma 2's local and global pair), named by their first layer's index."""

    first: int
    template: int
    copies: list[int]
    nodes: dict  # block -> its step nodes, in order
    params: dict  # block -> its parameter indices, in the order its nodes first read them
    carried: list[int]  # positions in a block's nodes of the values the next block reads
    span: dict  # block -> its layers' indices

    def before(self, k: int) -> int:
        """The block before block ``k`` of the run."""
        order = [self.first, self.template, *self.copies]
        return order[order.index(k) - 1]

    def note(self) -> str:
        """Which layers were copied, for ``explain``."""
        what = self.span[self.template]
        src = f"layer {what[0]}" if len(what) == 1 else f"layers {what[0]}-{what[-1]}"
        return f"layers {self.span[self.copies[0]][0]}-{self.span[self.copies[-1]][-1]} copied from {src}'s replay"


def _layer(n: fx.Node):
    return n.meta.get("custom", {}).get("layer")


def _val_key(v):
    if isinstance(v, torch.Tensor):
        if any(not isinstance(d, int) for d in (*v.shape, *v.stride())):
            return None
        return (tuple(v.shape), v.stride(), v.dtype)
    if isinstance(v, (tuple, list)):
        return tuple(_val_key(x) for x in v)
    return repr(v) if isinstance(v, (int, float, bool, type(None))) else None


def find_runs(gm: fx.GraphModule, n_params: int) -> list[Run]:
    """The runs of at least three identical blocks in the step graph (see the module's
    docstring): blocks of one layer, or, where those leave most layers out (layers of two or
    more kinds in turn), of a period of 2, 3, 4 or 6 layers."""
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    by_layer: dict = {}
    for n in nodes:
        if n.op == "call_function" and _layer(n) is not None:
            by_layer.setdefault(_layer(n), []).append(n)
    blocks = []  # (layer, its nodes) in graph order, each contiguous
    for layer, ns in by_layer.items():
        if pos[ns[-1]] - pos[ns[0]] + 1 != len(ns):
            return []  # interleaved with other nodes: not a block
        blocks.append((layer, ns))
    blocks.sort(key=lambda b: pos[b[1][0]])
    phs = [n for n in nodes if n.op == "placeholder"]
    trained = {n for n in phs[:n_params] if n.meta.get("trained", True)}
    depends = _dependents(nodes, trained)
    best = _runs_of([(b[0], [b[0]], b[1]) for b in blocks], pos, phs, n_params, depends)
    for period in (2, 3, 4, 6):
        if _covered(best) * 2 >= len(blocks):
            break
        for off in range(period):
            groups = []
            for i in range(off, len(blocks) - period + 1, period):
                part = blocks[i:i + period]
                if all(pos[a[1][-1]] + 1 == pos[b[1][0]] for a, b in zip(part, part[1:])):
                    groups.append((part[0][0], [b[0] for b in part], [n for b in part for n in b[1]]))
            found = _runs_of(groups, pos, phs, n_params, depends)
            if _covered(found) > _covered(best):
                best = found
    return best


def _covered(runs: list[Run]) -> int:
    return sum(len(r.span[k]) for r in runs for k in r.copies)


def _runs_of(blocks: list, pos: dict, phs: list, n_params: int, depends: set) -> list[Run]:
    """The runs among ``blocks`` (name, layers, nodes), consecutive in the graph."""
    keys = [None] * len(blocks)  # each block's description relative to the one before it
    for b in range(1, len(blocks)):
        prev, mine = blocks[b - 1][2], blocks[b][2]
        if pos[prev[-1]] + 1 == pos[mine[0]]:  # (else something lies between them)
            keys[b] = _relative_key(mine, prev, phs, n_params, depends)
    runs = []
    b = 1
    while b < len(blocks):
        e = b
        while e + 1 < len(blocks) and keys[b] is not None and keys[e + 1] == keys[b]:
            e += 1
        if keys[b] is not None and e - b >= 1 and _ops_key(blocks[b - 1][2]) == _ops_key(blocks[b][2]):
            run = _run(blocks[b - 1:e + 1], phs)
            if run is not None:
                runs.append(run)
        b = e + 1
    return runs


def _dependents(nodes, roots: set) -> set:
    dep = set(roots)
    for n in nodes:
        if n not in dep and any(a in dep for a in n.all_input_nodes):
            dep.add(n)
    return dep


def _ops_key(ns: list) -> tuple:
    """A block's operations on its relative inputs (which input, which of its nodes), with shapes."""
    inside = {n: j for j, n in enumerate(ns)}
    ins: dict = {}
    for n in ns:
        for a in n.all_input_nodes:
            if a not in inside:
                ins.setdefault(a, len(ins))

    def ref(a):
        return ("n", inside[a]) if a in inside else ("in", ins[a])

    return tuple((n.op, str(n.target), repr(fx.node.map_arg((n.args, n.kwargs), ref)), _val_key(n.meta.get("val")))
                 for n in ns)


def _relative_key(mine: list, prev: list, phs: list, n_params: int, depends: set):
    """``mine``'s operations and what each of its inputs is: its own parameter (read by it
    alone), the previous block's node at a position, or a shared value (the same node for every
    layer of a run; none a trained value's descendant). None where a layer reads anything else."""
    inside, before = set(mine), {n: j for j, n in enumerate(prev)}
    kinds: dict = {}
    for n in mine:
        for a in n.all_input_nodes:
            if a in inside or a in kinds:
                continue
            if a.op == "placeholder" and all(u in inside for u in a.users):
                kinds[a] = ("own", _val_key(a.meta.get("val")), a.meta.get("trained"))
            elif a in before:
                kinds[a] = ("carried", before[a])
            elif a in depends or a.op == "placeholder" and phs.index(a) < n_params:
                return None  # a trained value shared between layers: its gradient sums over them
            else:
                kinds[a] = ("shared", a)
    return _ops_key(mine), tuple(kinds.values())


def _run(blocks: list, phs: list) -> Run | None:
    names = [b[0] for b in blocks]
    nodes = {b[0]: b[2] for b in blocks}
    index = {p: i for i, p in enumerate(phs)}
    params = {}
    for name, _, ns in blocks:
        inside, own = set(ns), []
        for n in ns:
            for a in n.all_input_nodes:
                if a.op == "placeholder" and a not in own and all(u in inside for u in a.users):
                    own.append(a)
        params[name] = [index[a] for a in own]
    # Readers of a block's values: the next block only (the run's last: anything after it).
    carried = set()
    for k in range(len(names) - 1):
        inside, nxt = set(nodes[names[k]]), set(nodes[names[k + 1]])
        for j, n in enumerate(nodes[names[k]]):
            outside = [u for u in n.users if u not in inside]
            if any(u not in nxt for u in outside):
                return None
            if outside and k == 1:
                carried.add(j)
    if not carried or any(len(params[x]) != len(params[names[1]]) for x in names[1:]):
        return None
    return Run(names[0], names[1], names[2:], nodes, params, sorted(carried), {b[0]: b[1] for b in blocks})


def reduced(gm: fx.GraphModule, runs: list[Run]) -> fx.GraphModule:
    """``gm`` without the runs' copies: what read the last layer of a run reads the template."""
    drop = {n for r in runs for c in r.copies for n in r.nodes[c]}
    sub = {}
    for r in runs:
        for a, b in zip(r.nodes[r.copies[-1]], r.nodes[r.template]):
            sub[a] = b
    g = fx.Graph()
    env: dict = {}
    for n in gm.graph.nodes:
        if n not in drop:
            env[n] = g.node_copy(n, lambda a: env[sub.get(a, a)])
    assert all(env[n].name == n.name for n in env), "reduced: a node was renamed"
    return fx.GraphModule(gm, g)


class Recorder:
    """What ``expand`` needs to see of the reduced replay: the joint node holding the value of
    each watched step node, and of the gradient coming back into it (``replay``'s ``watch``)."""

    def __init__(self, runs: list[Run]):
        self.names = set()
        for r in runs:
            for layer in (r.first, r.template):
                self.names |= {r.nodes[layer][j].name for j in r.carried}
        self.value: dict = {}
        self.grad: dict = {}
        self.failed: str | None = None

    def __call__(self, n: fx.Node, out) -> None:
        if n.name not in self.names:
            return
        if not isinstance(out, torch.Tensor):
            self.failed = f"{n.name} hands on a {type(out).__name__}"
            return
        self.value[n.name] = _local_node(out)
        if out.requires_grad:
            out.register_hook(lambda g, name=n.name: self.grad.__setitem__(name, _local_node(g)))


def _is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _local_node(t: torch.Tensor) -> tuple:
    """(the node of ``t``'s local tensor, its placements: None for a plain tensor)."""
    from torch.distributed.tensor import DTensor
    from torch.fx.experimental.proxy_tensor import get_innermost_proxy_mode, get_proxy_slot

    spec = None
    if isinstance(t, DTensor):
        spec = (tuple(t.placements), tuple(t.shape))
        t = t._local_tensor
    return get_proxy_slot(t, get_innermost_proxy_mode().tracer).proxy.node, spec


def alike(r: Run, rules, layout) -> bool:
    """Whether the plan places the run's copies as its template: each parameter alike (TP and
    data-parallel placement, local shape), and the TP rules name the same places in each layer
    (the outputs that go back to the residual placement, the inputs read gathered)."""
    t = r.template
    for k in r.copies:
        for a, b in zip(r.params[t], r.params[k]):
            if a >= len(layout.shapes) or b >= len(layout.shapes):
                continue  # a buffer
            if (layout.tp.get(a), layout.tp_local_shape(a), layout.dp.get(a)) != (
                    layout.tp.get(b), layout.tp_local_shape(b), layout.dp.get(b)):
                return False
    if rules is None:
        return True

    def places(k: int) -> tuple:
        mine = {n: j for j, n in enumerate(r.nodes[k])}
        before = {n: j for j, n in enumerate(r.nodes[r.before(k)])}

        def ref(a):
            return ("own", mine[a]) if a in mine else ("before", before[a]) if a in before else ("shared", a)

        residual = frozenset(mine[n] for n in r.nodes[k] if n in rules.to_residual)
        gathered = frozenset((ref(a), mine[u]) for a, us in rules.gathered.items() for u in us if u in mine)
        return residual, gathered

    want = places(t)
    return all(places(k) == want for k in r.copies)


def expand(joint: fx.GraphModule, runs: list[Run], rec: Recorder, step_names: dict, param_names: list[str],
           layer_names: list[str], n_outs: int, wrt: list[int]) -> None:
    """Widen ``joint`` (the reduced step's) to every layer of ``runs``, in place. ``step_names``:
    layer -> its step nodes' names (the copies', gone from the reduced step); ``wrt``: the
    parameter index of each gradient the joint returns after its ``n_outs`` outputs;
    ``layer_names``: each layer's module."""
    if rec.failed:
        raise NotStampable(rec.failed)
    for r in runs:
        _expand_run(joint, r, rec, step_names, param_names, layer_names, n_outs, wrt)
    joint.graph.lint()
    joint.recompile()


def _expand_run(joint, r: Run, rec: Recorder, step_names, param_names, layer_names, n_outs, wrt) -> None:
    g = joint.graph
    nodes = list(g.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    phs = [n for n in nodes if n.op == "placeholder"]
    output = nodes[-1]
    tangents = {n for n in phs if n.name.startswith("tangents")}
    bw_start = next((i for i, n in enumerate(nodes) if any(a in tangents for a in n.all_input_nodes)), None)
    if bw_start is None:
        raise NotStampable("no backward")
    t, first = r.template, r.first
    t_names = {n.name for n in r.nodes[t]}
    t_params = set(r.params[t])
    fw = [n for n in nodes[:bw_start] if n.op == "call_function" and (
        n.meta.get("custom", {}).get("source") in t_names or n.meta.get("custom", {}).get("param_index") in t_params)]
    if not fw:
        raise NotStampable("the template made no forward nodes")
    carried_t = [r.nodes[t][j].name for j in r.carried]
    carried_f = [r.nodes[first][j].name for j in r.carried]
    try:
        v_in = [rec.value[x] for x in carried_f]
        v_out = [rec.value[x] for x in carried_t]
    except KeyError as e:
        raise NotStampable(f"no value recorded for {e}") from None
    with_grad = [j for j, x in enumerate(carried_t) if x in rec.grad or carried_f[j] in rec.grad]
    if any(carried_t[j] not in rec.grad or carried_f[j] not in rec.grad for j in with_grad):
        raise NotStampable("a carried value gets a gradient on one side only")
    g_out = [rec.grad[carried_t[j]] for j in with_grad]
    g_in = [rec.grad[carried_f[j]] for j in with_grad]
    # The fixed point: what the template reads and hands on, and their gradients, alike (local
    # shapes, strides, dtypes, and placements on the mesh).
    for (a, sa), (b, sb) in [*zip(v_in, v_out), *zip(g_in, g_out)]:
        if sa != sb or _val_key(a.meta.get("val")) != _val_key(b.meta.get("val")) or _val_key(a.meta.get("val")) is None:
            raise NotStampable(f"{a.name} and {b.name} differ")
    v_in, v_out, g_in, g_out = ([x for x, _ in xs] for xs in (v_in, v_out, g_in, g_out))
    out_args = list(output.args[0])
    grad_at = {p: n_outs + i for i, p in enumerate(wrt)}
    # (parameters that train: those the joint returns a gradient for; buffers and frozen ones not)
    graded = [(k, a, b) for k in r.copies for a, b in zip(r.params[t], r.params[k]) if a in grad_at or b in grad_at]
    if any(a not in grad_at or b not in grad_at for _, a, b in graded):
        raise NotStampable("a parameter trains in one layer and not in another")
    pg = [out_args[grad_at[p]] for p in r.params[t] if p in grad_at]
    if any(not isinstance(x, fx.Node) for x in pg):
        raise NotStampable("a template parameter's gradient is not a node")
    # The template's backward: what makes its parameters' gradients and the gradient it hands
    # down, from the gradients coming into its outputs.
    above = ancestors(set(g_out))
    below = ancestors(set(g_in) | set(pg)) - above
    bw = [n for n in nodes[bw_start:] if n.op == "call_function" and n in below]
    bw_set = set(bw)
    fw_set = set(fw)
    if fw_set & bw_set:
        raise NotStampable("forward and backward overlap")
    # What they read from outside: the template's parameters, what the first layer handed it,
    # the gradients into its outputs, values made before the run's first layer.
    run_start = min(pos[n] for n in nodes[:bw_start] if n.meta.get("custom", {}).get("source")
                    in {x.name for x in r.nodes[first]} or n.meta.get("custom", {}).get("param_index")
                    in set(r.params[first]))
    allowed = {phs[p] for p in r.params[t]} | set(v_in) | set(g_out)
    others = {phs[p] for ps in r.params.values() for p in ps} - allowed
    mine = fw_set | bw_set
    for n in (*fw, *bw):
        for a in n.all_input_nodes:
            if a in mine or a in allowed:
                continue
            if a.op == "placeholder":
                if a in others:
                    raise NotStampable(f"{n.name} reads another layer's parameter {a.name}")
                continue
            if pos[a] >= run_start:
                raise NotStampable(f"{n.name} reads {a.name}, made inside the run")
    # Who reads them from outside: the forward's values, what comes after the run (then the
    # last copy's); the backward's, the layer below (its gradient) and the output.
    last_fw = max(pos[n] for n in fw)
    fw_readers = {}
    for n in fw:
        for u in n.users:
            if u not in mine:
                if pos[u] <= last_fw:
                    raise NotStampable(f"{u.name} reads the template's {n.name} inside its forward")
                fw_readers.setdefault(u, []).append(n)
    below_first = _descendants(g_in)  # the first layer's backward and what follows it
    if any(u in below_first for u in fw_readers):
        raise NotStampable("the layer below reads the template's forward in its backward")
    g_in_set = set(g_in)
    for n in bw:
        for u in n.users:
            if u not in mine and u is not output and n not in g_in_set:
                raise NotStampable(f"{u.name} reads the template's backward node {n.name}")
    g_out_readers = {u for x in g_out for u in x.users if u in bw_set}
    if not bw:
        raise NotStampable("the template has no backward")
    first_bw = min(bw, key=pos.__getitem__)
    if any(pos[x] > pos[first_bw] for x in g_out if x in pos):
        raise NotStampable("a gradient into the template comes after its backward starts")

    # Copies: forwards after the template's, in order; backwards before its, last layer first.
    owned = _owned_storages(nodes, fw_set | bw_set)
    copiers: dict = {}
    anchor = fw[-1].next
    prev_out = dict(zip(v_in, v_out))  # what the next copy reads for what the template read
    for k in r.copies:
        c = copiers[k] = _Copier(g, owned, _retag(t, k, r, step_names, param_names, layer_names))
        c.bind({phs[a]: phs[b] for a, b in zip(r.params[t], r.params[k])})
        c.bind(prev_out)
        with g.inserting_before(anchor):
            for n in fw:
                c.copy(n)
        prev_out = {a: c.m[b] for a, b in zip(v_in, v_out)}
    incoming = dict(zip(g_out, g_out))  # the last copy's incoming gradients: the template's
    for k in reversed(r.copies):
        c = copiers[k]
        c.bind(incoming)
        with g.inserting_before(first_bw):
            for n in bw:
                c.copy(n)
        incoming = {a: c.m[b] for a, b in zip(g_out, g_in)}
    for u in g_out_readers:  # the template now takes the gradient from the copy above it
        _remap(u, incoming)
    last = copiers[r.copies[-1]].m
    for u in fw_readers:  # what came after the template now reads the last copy
        _remap(u, {a: last[a] for a in fw_readers[u]})
    # A value that viewed what a node now reads instead views the new input's storage.
    _move_storages(bw, {_storage(a): b for a, b in incoming.items()})
    copied = {x for c in copiers.values() for x in c.m.values()}
    _move_storages([n for n in nodes if n not in mine and n not in copied],
                   {_storage(a): last[a] for a in fw if _storage(a) in owned})
    # The copies' parameters' gradients, where the reduced replay had zeros.
    dead = []
    for k, a, b in graded:
        made = copiers[k].m.get(out_args[grad_at[a]])
        if made is None:
            raise NotStampable(f"no gradient for parameter {param_names[b]}")
        dead.append(out_args[grad_at[b]])
        out_args[grad_at[b]] = made
    output.args = (out_args,)
    for x in dead:
        if isinstance(x, fx.Node):
            _erase_unused(g, x)


def _remap(u: fx.Node, m: dict) -> None:
    u.args = fx.node.map_arg(u.args, lambda a: m.get(a, a))
    u.kwargs = fx.node.map_arg(u.kwargs, lambda a: m.get(a, a))


def _descendants(roots: list) -> set:
    seen, todo = set(), list(roots)
    while todo:
        n = todo.pop()
        for u in n.users:
            if u not in seen and u.op != "output":
                seen.add(u)
                todo.append(u)
    return seen


def _erase_unused(g: fx.Graph, n: fx.Node) -> None:
    """Erase ``n`` (the reduced replay's stand-in gradient) and what only it read."""
    todo = [n]
    while todo:
        x = todo.pop()
        if x.op == "call_function" and not x.users:
            ins = x.all_input_nodes
            g.erase_node(x)
            todo.extend(ins)


def _storage(n: fx.Node):
    v = n.meta.get("val")
    return StorageWeakRef(v.untyped_storage()) if isinstance(v, torch.Tensor) else None


def _move_storages(nodes, moved: dict) -> None:
    """Each value of ``nodes`` in a storage of ``moved`` (storage -> the node now holding it)
    remade in that node's storage, same shape, strides and offset."""
    moved = {st: b.meta["val"].untyped_storage() for st, b in moved.items()
             if st is not None and isinstance(b.meta.get("val"), torch.Tensor)}
    if not moved:
        return

    def move(v):
        if isinstance(v, torch.Tensor) and _is_fake(v) and StorageWeakRef(v.untyped_storage()) in moved:
            return _on_storage(v, moved[StorageWeakRef(v.untyped_storage())])
        return v

    for n in nodes:
        if "val" in n.meta:
            n.meta["val"] = pytree.tree_map(move, n.meta["val"])


def _on_storage(v: torch.Tensor, storage) -> torch.Tensor:
    """A fake tensor like ``v`` in ``storage`` (made on the meta device and wrapped: no dispatch
    through the fake mode)."""
    from torch._subclasses.fake_tensor import FakeTensor

    meta = torch.empty(0, dtype=v.dtype, device="meta").set_(storage, v.storage_offset(), v.shape, v.stride())
    return FakeTensor(v.fake_mode, meta, v.device)


def _owned_storages(nodes: list, mine: set) -> set:
    """The storages a template node makes (its first holder, in graph order, is one of ``mine``)."""
    first: dict = {}
    for n in nodes:
        for v in pytree.tree_leaves(n.meta.get("val")):
            if isinstance(v, torch.Tensor):
                first.setdefault(StorageWeakRef(v.untyped_storage()), n)
    return {st for st, n in first.items() if n in mine}


class _Copier:
    """One copy of the template: node map ``m`` (template node -> the copy's), and the copy's
    storages, so that its values alias as the template's do: a storage the template makes is a
    new one per copy, a storage of a value mapped to another (its parameters, what the layer
    before it made) is that value's, a shared value's stays shared."""

    def __init__(self, g: fx.Graph, owned: set, retag):
        self.g, self.owned, self.retag = g, owned, retag
        self.m: dict = {}
        self.storages: dict = {}  # template storage -> a tensor of the copy's that holds it

    def bind(self, m: dict) -> None:
        for a, b in m.items():
            self.m[a] = b
            va, vb = a.meta.get("val"), b.meta.get("val")
            if isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor):
                self.storages.setdefault(StorageWeakRef(va.untyped_storage()), vb.untyped_storage())

    def copy(self, n: fx.Node) -> fx.Node:
        new = self.g.node_copy(n, lambda a: self.m.get(a, a))
        if "custom" in n.meta:
            new.meta["custom"] = self.retag(n.meta["custom"])
        new.meta["val"] = pytree.tree_map(self._fresh, n.meta.get("val"))
        self.m[n] = new
        return new

    def _fresh(self, v):
        """A value like ``v`` in the copy's storage for it."""
        if not isinstance(v, torch.Tensor):
            return v
        if not _is_fake(v):
            raise NotStampable(f"a value that is not a fake tensor: {type(v).__name__}")
        st = StorageWeakRef(v.untyped_storage())
        storage = self.storages.get(st)
        if storage is None:
            if st in self.owned:
                storage = torch.empty(v.untyped_storage().nbytes(), dtype=torch.uint8, device="meta").untyped_storage()
                self.storages[st] = storage
            else:
                storage = v.untyped_storage()  # a shared value's
        return _on_storage(v, storage)


def _retag(t: int, k: int, r: Run, step_names: dict, param_names: list[str], layer_names: list[str]):
    """The ``custom`` annotation of a copy, block ``k``, from the template's (block ``t``)."""
    names = dict(zip((n.name for n in r.nodes[t]), step_names[k]))
    names.update({param_names[a]: param_names[b] for a, b in zip(r.params[t], r.params[k])
                  if a < len(param_names) and b < len(param_names)})  # (not buffers)
    index = dict(zip(r.params[t], r.params[k]))
    layers = dict(zip(r.span[t], r.span[k]))

    def retag(custom: dict) -> dict:
        c = dict(custom)
        for key in ("layer", "use_layer"):
            if c.get(key) in layers:
                c[key] = layers[c[key]]
        if c.get("source") in names:
            c["source"] = names[c["source"]]
        if c.get("param_index") in index:
            c["param_index"] = index[c["param_index"]]
        module = c.get("module")
        if isinstance(module, str) and c.get("layer") in layers.values():
            mine, theirs = layer_names[c["layer"]], layer_names[next(a for a, b in layers.items() if b == c["layer"])]
            if module == theirs or module.startswith(theirs + "."):
                c["module"] = mine + module[len(theirs):]
        return c

    return retag


def same_graphs(a: fx.GraphModule, b: fx.GraphModule) -> None:
    """Raise unless ``a`` and ``b`` are the same graph node for node (operations, what each
    reads, annotations, value shapes, strides and dtypes), whatever the nodes are named."""
    na, nb = list(a.graph.nodes), list(b.graph.nodes)
    ia, ib = {n: i for i, n in enumerate(na)}, {n: i for i, n in enumerate(nb)}
    holders = [{}, {}]

    def desc(n, idx):
        # which earlier node first held each value's storage: the graphs' aliasing
        own = holders[idx is ib]
        alias = tuple(own.setdefault(StorageWeakRef(v.untyped_storage()), idx[n])
                      for v in pytree.tree_leaves(n.meta.get("val")) if isinstance(v, torch.Tensor))
        return (n.op, str(n.target), repr(fx.node.map_arg((n.args, n.kwargs), lambda x: idx[x])),
                n.meta.get("custom"), pytree.tree_map(_val_key, n.meta.get("val")), alias)

    for i, (x, y) in enumerate(zip(na, nb)):
        if desc(x, ia) != desc(y, ib):
            raise AssertionError(f"stamped joint differs at node {i}: {x.format_node()} {desc(x, ia)} | "
                                 f"{y.format_node()} {desc(y, ib)}")
    if len(na) != len(nb):
        raise AssertionError(f"stamped joint has {len(na)} nodes, the full replay {len(nb)}")
