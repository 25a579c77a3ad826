"""Pipeline parallelism cut from the traced graph.

The single-device forward graph (logits out; the loss runs in the schedule) is split at the
planned layer boundaries into one graph per pipeline stage, with no change to the user's module:

- a node of repeated layer ``L`` belongs to the stage the plan gives ``L``;
- a node that depends on no parameter and on no layer (positions, masks, rotary tables: functions
  of the buffers and the token ids) is *free*: every stage that needs it recomputes it;
- any other node runs on the latest stage among its inputs (the final norm, the head), or, when it
  depends on no layer (the embedding), on the earliest stage among its users;
- a value made on stage ``a`` and used on stage ``c`` crosses every boundary in between: each
  stage outputs what later stages need, and the token ids travel along;
- a parameter used on several stages (an output head tied to the input embedding) is an input
  of each of them: every rank holding one of those stages keeps a copy, and ``shared_params``
  says which stages share it (the runtime sums the copies' gradients, see ``TiedGrads``).

Each stage graph is an ordinary ``StepGraph`` (its parameters, buffers, inputs), so it goes through
the same passes and backend as a whole model; ``torch.distributed.pipelining`` schedules (GPipe,
1F1B, interleaved 1F1B, zero-bubble) run the compiled stages. Zero-bubble schedules run the
backward as two parts, input gradients then weight gradients: ``split_weight_gradients`` cuts
them from the partitioned backward graph.
"""

from __future__ import annotations

import operator

import torch

from autopar.capture import StepGraph
from autopar.errors import AutoparError
from autopar.fxops import ancestors
from autopar.passes import graph_module


def _stage_of_nodes(sg: StepGraph, layer_stage: dict[int, int], n_stages: int) -> tuple[dict, set]:
    gm = sg.gm
    phs = sg.placeholders()
    params = set(phs[: sg.n_params])
    stage: dict = {}
    free: set = set()
    pending = []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            if n not in params:
                free.add(n)  # buffers, token ids
            continue
        if n.op == "get_attr":
            free.add(n)
            continue
        if n.op == "output":
            continue
        layer = n.meta.get("custom", {}).get("layer")
        ins = n.all_input_nodes
        if layer is not None:
            stage[n] = layer_stage[layer]
        elif all(a in free for a in ins):
            free.add(n)
        else:
            upstream = [stage[a] for a in ins if a in stage]
            if upstream:
                stage[n] = max(upstream)
            else:
                pending.append(n)  # reads parameters only (an embedding lookup)

    def use_stages(n) -> list[int]:  # through the getitems of a multi-output op (a layer norm's)
        return [s for u in n.users for s in ([stage[u]] if u in stage else use_stages(u) if _is_getitem(u) else [])]

    for n in reversed(pending):
        if not _is_getitem(n):
            users = use_stages(n)
            stage[n] = min(users) if users else 0
    for n in pending:
        if _is_getitem(n):  # with its op, also where only its other outputs are used
            stage[n] = stage[n.args[0]]
    (out,) = gm.graph.find_nodes(op="output")
    for a in out.all_input_nodes:
        if a in stage and stage[a] != n_stages - 1:
            raise AutoparError("the model's output is computed before the last pipeline stage")
    return stage, free


def _is_getitem(n: torch.fx.Node) -> bool:
    return n.op == "call_function" and n.target is operator.getitem


def pipeline_split(sg: StepGraph, plan, ctx) -> list:
    """The pass: ``sg`` cut into the plan's ``pp x v`` stage graphs, each layer where the plan puts it."""
    return split(sg, layer_stages(sg, plan), plan.pp * plan.v)


def split(sg: StepGraph, layer_stage: dict[int, int], n_stages: int) -> list[StepGraph]:
    """One StepGraph per pipeline stage. Stage ``s``'s inputs: for ``s == 0`` the model inputs;
    else what stage ``s-1`` outputs (values for later stages, then the model inputs)."""
    gm = sg.gm
    phs = sg.placeholders()
    P, B = sg.n_params, len(sg.buffer_names)
    model_inputs = phs[P + B:]
    stage, free = _stage_of_nodes(sg, layer_stage, n_stages)
    # boundary[k]: values made on stages <= k and used on stages > k, in graph order.
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    need_after: dict = {}
    for n, s in stage.items():
        for a in n.all_input_nodes:
            if a in stage and stage[a] < s:
                need_after.setdefault(a, set()).add(s)
    boundaries = []
    for k in range(n_stages - 1):
        vals = sorted((v for v, users in need_after.items() if stage[v] <= k and max(users) > k), key=order.get)
        boundaries.append(vals)
    out_node = next(iter(gm.graph.find_nodes(op="output")))
    stages = []
    for s in range(n_stages):
        g = torch.fx.Graph()
        env: dict = {}
        mine = [n for n in gm.graph.nodes if stage.get(n) == s]
        needed_free = set()
        stack = [a for n in mine for a in n.all_input_nodes if a in free]
        while stack:
            x = stack.pop()
            if x in needed_free:
                continue
            needed_free.add(x)
            stack += [a for a in x.all_input_nodes if a in free]
        used_params = [i for i, ph in enumerate(phs[:P]) if any(stage.get(u) == s for u in ph.users)]
        used_bufs = [j for j, ph in enumerate(phs[P:P + B]) if ph in needed_free]
        for i in used_params:
            env[phs[i]] = _placeholder(g, phs[i])
        for j in used_bufs:
            env[phs[P + j]] = _placeholder(g, phs[P + j])
        received = boundaries[s - 1] if s > 0 else []
        for v in received:
            env[v] = _placeholder(g, v, name=f"recv_{v.name}")
        for x in model_inputs:
            env[x] = _placeholder(g, x)
        for n in gm.graph.nodes:
            if n.op in ("placeholder", "output") or n in env:
                continue
            if stage.get(n) == s or n in needed_free:
                env[n] = g.node_copy(n, lambda a: env[a])
        if s == n_stages - 1:
            g.output(torch.fx.node.map_arg(out_node.args[0], lambda a: env[a]))
        else:
            g.output([env[v] for v in boundaries[s]] + [env[x] for x in model_inputs])
        sgm = graph_module(gm, g)
        st = StepGraph(sgm, [sg.param_names[i] for i in used_params],
                       {sg.param_names[i]: sg.aliases.get(sg.param_names[i], []) for i in used_params},
                       [sg.buffer_names[j] for j in used_bufs], len(received) + len(model_inputs), False,
                       [], [tuple(v.meta["val"].shape) for v in received + model_inputs], sg.output_type,
                       final=s == n_stages - 1, n_received=len(received), first=s == 0)
        stages.append(st)
    return stages


def shared_params(stages: list[StepGraph]) -> dict[str, list[int]]:
    """Parameters used on more than one stage -> those stages, in order."""
    used: dict[str, list[int]] = {}
    for s, st in enumerate(stages):
        for name in st.param_names:
            used.setdefault(name, []).append(s)
    return {name: ss for name, ss in used.items() if len(ss) > 1}


def _placeholder(g: torch.fx.Graph, src: torch.fx.Node, name: str | None = None) -> torch.fx.Node:
    ph = g.placeholder(name or src.name)
    ph.meta = dict(src.meta)
    return ph


def layer_stages(sg: StepGraph, plan) -> dict[int, int]:
    """Layer index (in the traced graph) -> pipeline stage, from the plan."""
    by_fqn = {l.fqn: plan.stage_index(l.stage, l.chunk) for l in plan.layers}
    missing = [f for f in sg.layers if f not in by_fqn]
    if missing or len(sg.layers) != len(plan.layers):
        raise AutoparError(
            f"the plan's layers ({len(plan.layers)}, e.g. {plan.layers[0].fqn}) are not the model's repeated "
            f"layers ({len(sg.layers)}, e.g. {sg.layers[0] if sg.layers else 'none'}); plan this model again"
        )
    return {i: by_fqn[f] for i, f in enumerate(sg.layers)}


def split_weight_gradients(graphs, plan, ctx):
    """The pass: a ``StepGraphs``' backward also as its input-gradient and weight-gradient parts
    (``split_backward``; the first ``ctx.step.split_weight`` gradients are the weights')."""
    graphs.bw_input, graphs.bw_weight, graphs.n_input_grads = split_backward(graphs.bw, ctx.step.split_weight)
    return graphs


def _with_size_symbols(g: torch.fx.Graph, carried: list, in_i: set) -> list:
    """``carried`` with, first, the nodes of ``I`` (or the backward's inputs) that define the
    data-dependent sizes of the carried tensors (expert parallelism's routed row counts): ``W``
    takes them as inputs, as a graph must that holds tensors of those sizes."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    needed = set().union(*(free_unbacked_symbols(c.meta.get("val")) for c in carried))
    if not needed:
        return carried
    defs = [n for n in g.nodes if (n in in_i or n.op == "placeholder") and isinstance(n.meta.get("val"), torch.SymInt)
            and n.meta["val"].node.expr in needed]
    return defs + [c for c in carried if c not in defs]


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
    carried = _with_size_symbols(g, carried, in_i)

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
    return graph_module(bw, gi), graph_module(bw, gw), len(i_outs)
