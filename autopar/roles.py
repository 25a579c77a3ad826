"""Tensor-parallel roles of the linears in a graph, found by data flow, with no module names.

The one role finder: the planner runs it on each distinct block's graph (``analysis.analyze_block``
prices what it divides) and the executor on the traced training step (``passes/tp.tp_rules``
shards what it finds), so the plan ``explain`` prices is the one that runs. A *linear* is an
``mm``/``addmm`` of an activation with a 2-D parameter (through views, casts and transposes),
or a ``grouped_mm`` of routed experts' rows with one such parameter per expert (the experts'
same-named linears, one role for all); its role follows from where its input comes from
(``Roles``).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from autopar.fxops import ATTENTION_OPS, FEATURE_VIEWS, SPLIT_OPS, ZEROS
from autopar.grouped_mm import GROUPED_MM

_aten = torch.ops.aten
_PASS_OPS = {  # ops a weight passes through on its way into a matmul (dim 0 of the result swaps on t/transpose)
    _aten.t.default, _aten.transpose.int, _aten.view.default, _aten._unsafe_view.default,
    _aten.reshape.default, _aten._to_copy.default, _aten.alias.default, _aten.detach.default,
}
_LOOKUPS = {_aten.embedding.default}
_PICKS = {_aten.index.Tensor, _aten.index_select.default, _aten.gather.default}
_NORMS = {_aten.native_layer_norm.default, _aten.layer_norm.default, _aten.rms_norm.default}
_REDUCTIONS = {_aten.mean.dim, _aten.sum.dim_IntList, _aten.var.correction, _aten.var_mean.correction}
# Products of two activations (attention's scores and outputs): a reduction after one is over
# positions or heads, not over a linear's features.
_PRODUCTS = {_aten.bmm.default, _aten.baddbmm.default, _aten.matmul.default, *ATTENTION_OPS}


def _reduced_features(n: torch.fx.Node) -> int | None:
    """The size of the last dim that ``n`` normalizes or reduces over (a layer norm, an RMS
    norm's mean of squares), else None."""
    if n.op != "call_function" or n.target not in _NORMS | _REDUCTIONS:
        return None
    val = n.args[0].meta.get("val") if isinstance(n.args[0], torch.fx.Node) else None
    shape = getattr(val, "shape", None)
    if not shape:
        return None
    if n.target in _NORMS:
        return int(shape[-1]) if len(n.args[1]) >= 1 else None
    if n.target in _REDUCTIONS:
        dims = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
        dims = [dims] if isinstance(dims, int) else list(dims or [])
        if any(d in (-1, len(shape) - 1) for d in dims):
            return int(shape[-1])
    return None


@dataclass
class GraphLinear:
    """A matmul of an activation with a 2-D parameter in the step graph."""

    node: torch.fx.Node
    weight: int  # parameter index
    out_dim: int  # the weight's dimension that indexes output features (0: nn.Linear, 1: Conv1D)
    act: torch.fx.Node  # the activation operand
    bias: int | None = None
    role: str = "replicated"  # column | row | head | replicated
    parts: int = 1  # a fused projection split into this many equal parts (q, k, v)
    reason: str = ""  # why a linear stays replicated
    group: tuple[int, ...] = ()  # a grouped linear (routed experts): every expert's weight, ``weight`` the first
    stacked: bool = False  # a grouped linear of one 3-D weight (every expert's, leading): dims 1, 2 its features

    @property
    def weights(self) -> tuple[int, ...]:
        return self.group or (self.weight,)

    @property
    def grouped(self) -> bool:
        """Routed experts' grouped linear: each expert's weight on its own rows."""
        return bool(self.group) or self.stacked

    @property
    def in_dim(self) -> int:
        """The weight's dimension that indexes input features."""
        return 3 - self.out_dim if self.stacked else 1 - self.out_dim


@dataclass
class Roles:
    """Per-parameter roles found by data flow in a graph (no names involved).

    The *residual stream* starts at the graph's sources (the step's floating-point inputs, a
    block's hidden states) and at lookups into a parameter table (token and position
    embeddings), and flows through every op but a linear. A
    linear reading the residual stream is a column candidate; a linear whose input is computed
    only from column outputs (through head-local ops: element-wise, views, attention) is a row
    linear and makes its columns *columns*; a column candidate whose output reaches the graph's
    output without a row is the *head*. A normalization over all of a linear's output features
    (a layer norm between two projections) is not head-local: its output, like the residual
    stream, holds whole features, and the linears that read it are column (or head) candidates
    (a norm over one head's features, or a reduction after an attention product, is head-local).
    A column whose output is split into ``k`` equal parts along its features (fused QKV, gate/up)
    is sharded in ``k`` interleaved parts.
    """

    linears: list[GraphLinear]
    residual: set  # nodes on the residual stream
    token_tables: set  # parameter indices of embedding tables indexed by the model input
    gather_points: dict  # residual node -> set of nodes (view chains, linears) that read it gathered
    columns_of: dict  # row linear node -> its column linear nodes
    region: dict  # row linear node -> the nodes from its columns to it (TP-local: divided by the degree)
    reduce_at: dict  # row linear node -> the node where its partial sums are reduced (``_reduce_points``)

    def gathered(self) -> dict:
        """The gather points a matmul reads: TP gathers each of these inputs (under SP, its
        sequence shards) once for the columns that read it."""
        mms = (_aten.mm.default, _aten.addmm.default, GROUPED_MM)
        return {root: nodes for root, nodes in self.gather_points.items() if any(n.target in mms for n in nodes)}


def _integral(n: torch.fx.Node) -> bool:
    v = n.meta.get("val")
    return isinstance(v, torch.Tensor) and not v.is_floating_point()


def _is_2d_transpose(n: torch.fx.Node) -> bool:
    """``w.T`` / ``w.permute(1, 0)`` of a matrix (Falcon's linear computes ``x @ self.weight.T``)."""
    return n.target == _aten.permute.default and [d % 2 for d in n.args[1]] == [1, 0]


def _flips(n: torch.fx.Node) -> bool:
    """``n`` transposes a matrix."""
    return n.target in (_aten.t.default, _aten.transpose.int) or _is_2d_transpose(n)


def _weight_of(n: torch.fx.Node, pidx: dict) -> tuple[int | None, int]:
    flips = 0
    while isinstance(n, torch.fx.Node) and n.op == "call_function":
        flip = _flips(n)
        if not (flip or n.target in _PASS_OPS):
            break
        flips += flip
        n = n.args[0]
    if isinstance(n, torch.fx.Node) and n in pidx:
        return pidx[n], flips
    return None, 0


def _expert_slice(n: torch.fx.Node, pidx: dict) -> tuple[int | None, int]:
    """(parameter index, transposes) where ``n`` is one expert's matrix of a 3-D expert weight
    (``unbind(w)[e]`` or ``w[e]``, then transposed or not), else (None, 0)."""
    flips = 0
    while isinstance(n, torch.fx.Node) and n.op == "call_function" and _flips(n):
        flips += 1
        n = n.args[0]
    if not isinstance(n, torch.fx.Node) or n.op != "call_function":
        return None, 0
    if n.target is operator.getitem and isinstance(n.args[0], torch.fx.Node) and n.args[0].target == _aten.unbind.int:
        src, dim = n.args[0].args[0], (n.args[0].args[1] if len(n.args[0].args) > 1 else 0)
    elif n.target == _aten.select.int:
        src, dim = n.args[0], n.args[1]
    else:
        return None, 0
    if dim == 0 and src in pidx and src.meta["val"].dim() == 3:
        return pidx[src], flips
    return None, 0


def _split_parts(lin: torch.fx.Node, features: int) -> tuple[int, str]:
    """How a column's output is split along its features: (equal parts, '' or a reason)."""
    frontier = [lin]
    seen = set()
    while frontier:
        x = frontier.pop()
        if x in seen:
            continue
        seen.add(x)
        slices = []
        for u in x.users:
            v = u.meta.get("val")
            if u.op != "call_function":
                continue
            if ((u.target in FEATURE_VIEWS or u.target == _aten.unsqueeze.default) and isinstance(v, torch.Tensor)
                    and v.dim() and v.shape[-1] == features):  # GPT-BigCode: c_attn(x).unsqueeze(1).split(...)
                frontier.append(u)
            elif u.target in FEATURE_VIEWS and isinstance(v, torch.Tensor) and v.dim() > x.meta["val"].dim():
                # The features viewed as (A, B, ...) (heads, or groups of heads): TP gives each rank a
                # contiguous range of A, right when every index of A is treated alike.
                stacked = _stacked_parts(u, x.meta["val"].dim() - 1)
                if stacked:
                    return stacked, ""
                reason = _head_view_reason(u, x.meta["val"].dim() - 1)
                if reason:
                    return 1, reason
            elif u.target in SPLIT_OPS:
                if _split_dim(u) != -1:
                    continue
                outs = [o.shape[-1] for o in u.meta["val"]]
                if len(set(outs)) == 1 and len(outs) > 1:
                    return len(outs), ""
                return 1, f"its output is split into unequal parts {outs}"
            elif u.target == _aten.slice.Tensor and (u.args[1] % x.meta["val"].dim()) == x.meta["val"].dim() - 1:
                slices.append(u.meta["val"].shape[-1])
        if len(slices) > 1:
            if len(set(slices)) == 1 and sum(slices) == features:
                return len(slices), ""
            return 1, f"its output is sliced into unequal parts {slices}"
    return 1, ""


def _split_dim(n: torch.fx.Node) -> int:
    """The dim a split op splits along, negative (from the last)."""
    dim = n.args[2] if len(n.args) > 2 else n.kwargs.get("dim", 0)
    return dim - n.args[0].meta["val"].dim() if dim >= 0 else dim


def _tokens(gm: torch.fx.GraphModule, residual: set) -> int | None:
    """Tokens of the residual stream: the rows of its first value (a block's hidden states, a
    token embedding), None where its first value is not floating-point features."""
    first = next((n for n in gm.graph.nodes if n in residual), None)
    val = first.meta.get("val") if first is not None else None
    if not isinstance(val, torch.Tensor) or val.dim() < 2 or not val.is_floating_point():
        return None
    return val.shape[:-1].numel()


def _shared_by_heads(n: torch.fx.Node, tokens: int | None) -> bool:
    """Whether ``n`` expands a value with one head's features per token (``tokens`` x its
    last dim) along size-1 dims: the same values for every head."""
    if tokens is None or n.op != "call_function" or n.target != _aten.expand.default:
        return False
    src, out = n.args[0].meta.get("val"), n.meta.get("val")
    if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor) or src.dim() != out.dim():
        return False
    return src.numel() == tokens * src.shape[-1] and out.numel() > src.numel()


def _stacked_parts(view: torch.fx.Node, d: int) -> int:
    """A column's features viewed as (A, heads, head_dim) with ``A`` leading at dim ``d`` and
    unbound along it, possibly after transposes (ModernBERT's ``Wqkv(x).view(B, S, 3, H, D)
    .transpose(3, 1).unbind(2)``): ``A`` stacked equal parts (q, k, v), as if split. 0 if not."""
    a = view.meta["val"].shape[d]
    frontier, found = [(view, d)], False
    while frontier:
        x, dim = frontier.pop()
        for u in x.users:
            if u.op != "call_function":
                return 0
            nd = u.meta["val"].dim() if isinstance(u.meta.get("val"), torch.Tensor) else x.meta["val"].dim()
            if u.target == _aten.transpose.int:
                d0, d1 = (i % nd for i in u.args[1:3])
                frontier.append((u, d1 if dim == d0 else d0 if dim == d1 else dim))
            elif u.target == _aten.permute.default:
                frontier.append((u, [i % nd for i in u.args[1]].index(dim)))
            elif u.target in (_aten.clone.default, _aten.contiguous.default, _aten._to_copy.default):
                frontier.append((u, dim))
            elif u.target == _aten.unbind.int and (u.args[1] if len(u.args) > 1 else 0) % nd == dim and a > 1:
                found = True
            else:
                return 0
    return a if found else 0


def _head_view_reason(view: torch.fx.Node, d: int) -> str:
    """A column's features viewed with dim ``d`` leading them: indexing along ``d`` (Falcon's
    multi-query ``qkv[..., :-2, :]`` and ``qkv[..., [-2], :]``: one K and one V head shared by all
    query heads) treats its entries differently, and no contiguous range of them is a rank's
    share: replicated, with the reason."""
    a = view.meta["val"].shape[d]
    for u in view.users:
        if u.op != "call_function":
            continue
        along = False
        if u.target in (_aten.slice.Tensor, _aten.narrow.default):  # a full-range slice is a no-op
            along = u.args[1] % view.meta["val"].dim() == d and u.meta["val"].shape[d] != a
        elif u.target == _aten.unbind.int:
            along = (u.args[1] if len(u.args) > 1 else 0) % view.meta["val"].dim() == d
        elif u.target == _aten.select.int:
            along = u.args[1] % view.meta["val"].dim() == d
        elif u.target in SPLIT_OPS:
            along = (u.args[2] if len(u.args) > 2 else u.kwargs.get("dim", 0)) % view.meta["val"].dim() == d
        elif u.target == _aten.index.Tensor:
            idx = u.args[1]
            along = len(idx) > d and idx[d] is not None
        if along:
            return (f"its output is viewed as {tuple(view.meta['val'].shape[d:])} and indexed along the first "
                    f"of those ({a} entries) unevenly, e.g. query heads beside one shared key/value head")
    return ""


def _token_rows(x: torch.fx.Node, linears: dict) -> bool:
    """``x`` picks rows of a token matrix for grouped linears only (routed experts' tokens in
    expert order): the tokens are gathered before the pick, once for all the experts' rows."""
    return (x.target == _aten.index.Tensor and len(x.args[1]) == 1
            and all(u in linears and linears[u].grouped for u in x.users))


def _read_as_tokens(x: torch.fx.Node, linears: dict, sibling: bool = False) -> bool:
    """``x`` (a view) is read only as linears' input (one linear, or a block's router, shared
    and routed experts; and for its shape): it is gathered where its source is, before the view, once for them all
    (under SP the source's sequence shards are gathered whole; the view of them stays local).
    A view of it whose every reader is such (``sibling``: its one reader must be too) counts as
    such a reader (transformers 5's Mixtral router reshapes the tokens its block already
    flattened for the experts)."""
    return (len(x.users) == 1 and not sibling) or all(
        (u in linears and linears[u].act is x) or _token_rows(u, linears)
        or u.target in ZEROS  # zeros_like reads the shape only
        or (u.target in FEATURE_VIEWS and _read_as_tokens(u, linears, sibling=True)) for u in x.users)


def _narrows(x: torch.fx.Node) -> bool:
    """``x`` casts to a dtype of fewer bytes (mixed precision's cast of the tokens to the compute
    dtype): the tokens are gathered after it, at its size, not before it at the wider one."""
    src = x.args[0].meta.get("val") if isinstance(x.args[0], torch.fx.Node) else None
    out = x.meta.get("val")
    return (x.target == _aten._to_copy.default and src is not None and out is not None
            and out.dtype.itemsize < src.dtype.itemsize)


def step_roles(sg) -> Roles:
    """The roles in a traced step (``capture.StepGraph``): the residual stream starts at the
    model's floating-point inputs and at lookups of its integer inputs."""
    phs = sg.placeholders()
    inputs = phs[sg.n_params + len(sg.buffer_names): sg.n_params + len(sg.buffer_names) + sg.n_inputs]
    return find_roles(sg.gm, {n: i for i, n in enumerate(phs[: sg.n_params])},
                      [x for x in inputs if x.meta["val"].is_floating_point()], inputs)


def head_feeds_cross_entropy(sg) -> bool:
    """Whether the loss of a traced step (``capture.StepGraph`` with its loss) reads the head's
    logits through a log-softmax (cross-entropy): the one loss that runs on vocabulary shards
    (loss parallelism). Any other loss (a diffusion model's MSE of its patch outputs) reads whole
    logits: DTensor's mean-reduced MSE on shards averages the loss right but scales its gradient
    by the shard count (measured, torch 2.13)."""
    heads = [lin.node for lin in step_roles(sg).linears if lin.role == "head"]
    seen, stack = set(), list(heads)
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "call_function" and n.target in (_aten._log_softmax.default, _aten.log_softmax.int):
            return True
        stack += list(n.users)
    return False


def find_roles(gm: torch.fx.GraphModule, pidx: dict, sources: list, ids: list = ()) -> Roles:
    """The roles of ``gm``'s linears. ``pidx``: parameter placeholder -> parameter index;
    ``sources``: the nodes where the residual stream starts (floating-point inputs, a block's
    hidden states); ``ids``: the integer inputs whose embedding tables are token tables."""
    phs = {i: n for n, i in pidx.items()}
    linears: dict[torch.fx.Node, GraphLinear] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target == GROUPED_MM:
            found = [_weight_of(w, pidx) for w in n.args[1]]
            if all(w is not None and not flips and phs[w].meta["val"].dim() == 2 for w, flips in found):
                ws = tuple(w for w, _ in found)
                linears[n] = GraphLinear(n, ws[0], 0, n.args[0], group=ws)
                continue
            # Every expert's matrix of one 3-D weight, in expert order: the experts' (out, in)
            # matrices are its dims (1, 2), or (2, 1) where each is transposed first (gpt-oss).
            found = [_expert_slice(w, pidx) for w in n.args[1]]
            if (found and len(set(found)) == 1 and found[0][0] is not None
                    and phs[found[0][0]].meta["val"].shape[0] == len(found)):
                w, flips = found[0]
                linears[n] = GraphLinear(n, w, 2 if flips % 2 else 1, n.args[0], stacked=True)
            continue
        if n.op != "call_function" or n.target not in (_aten.mm.default, _aten.addmm.default):
            continue
        a, b = (n.args[0], n.args[1]) if n.target == _aten.mm.default else (n.args[1], n.args[2])
        w, flips = _weight_of(b, pidx)
        if w is None or phs[w].meta["val"].dim() != 2:
            continue
        bias = None
        if n.target == _aten.addmm.default:
            bias, _ = _weight_of(n.args[0], pidx)
        linears[n] = GraphLinear(n, w, 0 if flips % 2 else 1, a, bias)

    residual: set = set(sources)
    token_tables: set = set()
    ids = set(ids)
    for n in gm.graph.nodes:
        if n.op != "call_function" or n in linears:
            continue
        if n.target in _LOOKUPS and n.args[0] in pidx:
            residual.add(n)
            idx = n.args[1]
            while isinstance(idx, torch.fx.Node) and idx.op == "call_function" and idx.target in FEATURE_VIEWS:
                idx = idx.args[0]  # the ids reshaped (GPT-2 views them as (-1, seq))
            if idx in ids:
                token_tables.add(pidx[n.args[0]])
        elif any(a in residual for a in n.all_input_nodes):
            residual.add(n)

    walked: dict = {}
    tokens = _tokens(gm, residual)
    shared: set = set()  # expands of one head's values per token to every head

    def walk(x: torch.fx.Node, through_products: bool = True) -> tuple[set, set]:
        """The linears ``x`` is computed from without passing through a linear (nor, unless
        ``through_products``, a product of two activations: attention's), and the nodes on the
        way (each walk once: the role tests ask for the same activations again). A value with
        one head per token expanded to every head (multi-head latent attention's rotary key) is
        the same for every head shard: the walk does not go past it (``_shared_by_heads``)."""
        if (x, through_products) in walked:
            return walked[x, through_products]
        seen, stack, out = set(), [x], set()
        while stack:
            y = stack.pop()
            if y in seen:
                continue
            seen.add(y)
            if y in linears:
                out.add(y)
            elif y is not x and _shared_by_heads(y, tokens):
                shared.add(y)
            elif y not in pidx and (through_products or y.op != "call_function" or y.target not in _PRODUCTS):
                # Not into the indices of a pick (routed rows' experts and tokens): no features.
                stack += [a for a in y.all_input_nodes if not (y.target in _PICKS and _integral(a))]
        walked[x, through_products] = out, seen
        return out, seen

    def normalized(x: torch.fx.Node) -> bool:
        """Whether ``x`` is a linear's output normalized over all its output features (through
        element-wise ops and views, no attention product in between: a layer norm between two
        projections, as in a masked-LM head or a low-rank query): a whole-feature stream, which
        no feature shard computes. A query normalized before attention (OLMo 2) is not: what
        attention makes of it is per head."""
        fr, between = walk(x, through_products=False)
        sizes = {int(phs[linears[f].weight].meta["val"].shape[linears[f].out_dim]) for f in fr}
        # A part of those features split off along the last dim (multi-head latent attention's
        # compressed latent beside its rotary key) normalized as a whole is whole too.
        sizes |= {int(o.shape[-1]) for y in between if y.op == "call_function" and y.target in SPLIT_OPS
                  and _split_dim(y) == -1 and int(y.args[0].meta["val"].shape[-1]) in sizes
                  for o in y.meta["val"]}
        return any(_reduced_features(y) in sizes and not any(z.target in _PRODUCTS for z in walk(y, False)[1])
                   for y in between if y not in fr)

    whole_of: dict = {}

    def whole(x: torch.fx.Node) -> bool:
        if x not in whole_of:
            whole_of[x] = x in residual or normalized(x)
        return whole_of[x]

    columns_of: dict = {}
    region: dict = {}
    for lin in linears.values():
        if whole(lin.act):
            continue
        fr, between = walk(lin.act)
        if fr and all(whole(linears[f].act) for f in fr):
            lin.role = "row"
            columns_of[lin.node], region[lin.node] = fr, between
            for f in fr:
                linears[f].role = "column"
    outputs = set(gm.graph.find_nodes(op="output"))

    def reaches_output(x: torch.fx.Node) -> bool:
        seen, stack = set(), [x]
        while stack:
            y = stack.pop()
            if y in outputs:
                return True
            if y in seen or (y in linears and y is not x):
                continue
            seen.add(y)
            stack += list(y.users)
        return False

    for lin in linears.values():
        if lin.role == "replicated" and whole(lin.act) and reaches_output(lin.node):
            lin.role = "head"
    for lin in linears.values():
        if lin.role == "column":
            features = phs[lin.weight].meta["val"].shape[lin.out_dim]
            lin.parts, lin.reason = _split_parts(lin.node, features)
            if lin.reason:
                lin.role = "replicated"
    # A row reads its columns' shards: all of them sharded, or none (to a fixed point: a column
    # demoted with one row may feed another).
    changed = True
    while changed:
        changed = False
        for row, cols in columns_of.items():
            if linears[row].role == "row" and any(linears[c].role != "column" for c in cols):
                linears[row].role = "replicated"
                linears[row].reason = "it reads the output of a linear that stays replicated"
                for c in cols:
                    if linears[c].role == "column":
                        linears[c].role, linears[c].reason = "replicated", "its row partner stays replicated"
                changed = True
    for e in shared:  # what only every head's shared copy reads stays whole, said why
        for f in walk(e.args[0], through_products=False)[0]:
            lin = linears[f]
            if lin.role == "replicated" and not lin.reason:
                lin.reason = "its output is shared by every head (expanded to them), so each rank computes it whole"
    # Where a column reads the residual stream: the residual node its activation is a view of.
    gather_points: dict = {}
    for lin in linears.values():
        if lin.role not in ("column", "head"):
            continue
        chain, x = [lin.node], lin.act
        while x.op == "call_function" and ((x.target in FEATURE_VIEWS and _read_as_tokens(x, linears)
                                            and not _narrows(x))
                                           or (lin.grouped and _token_rows(x, linears))):
            chain.append(x)
            x = x.args[0]
        gather_points.setdefault(x, set()).update(chain)
    rows = {n for n, lin in linears.items() if lin.role == "row"}
    return Roles(list(linears.values()), residual, token_tables, gather_points,
                 {r: c for r, c in columns_of.items() if r in rows}, {r: b for r, b in region.items() if r in rows},
                 _reduce_points(gm, [n for n in linears if n in rows]))


# Ops linear in their first operand and in no other: a partial sum passes through them unreduced.
_LINEAR_IN_FIRST = {*FEATURE_VIEWS, _aten.index.Tensor, _aten.select.int, _aten.unsqueeze.default,
                    _aten.squeeze.dim, _aten._to_copy.default, _aten.clone.default, _aten.sum.dim_IntList,
                    _aten.permute.default, _aten.transpose.int, _aten.div.Tensor}
_SUMS = {_aten.add.Tensor, _aten.sub.Tensor}


def _keeps_partial(n: torch.fx.Node, partial: set) -> bool:
    """Whether ``n`` applied to partial sums (the nodes ``partial``) gives a partial sum."""
    ins = [a in partial for a in n.all_input_nodes]
    if n.target in _LINEAR_IN_FIRST:
        return n.args[0] in partial and sum(ins) == 1
    if n.target == _aten.mul.Tensor:
        return sum(ins) == 1
    if n.target in _SUMS:
        return any(ins) and all(a in partial or (a.op == "call_function" and a.target in ZEROS)
                                for a in n.all_input_nodes)
    if n.target == _aten.index_add.default:  # rows added onto their tokens (experts in 3-D parameters)
        base, idx, src = n.args[0], n.args[2], n.args[3]
        return src in partial and idx not in partial and (base in partial or base.target in ZEROS)
    return False


def _reduce_points(gm: torch.fx.GraphModule, rows: list) -> dict:
    """Where each row linear's partial sums are reduced over TP: after the ops that keep them
    partial on the way back to the residual stream (views; routed experts' weighting, reordering
    and adding of each token's rows; a shared expert's gate and its sum with the routed experts';
    parallel attention and MLP outputs added), so one reduce of tokens x features serves them all.
    A row whose partial sums reach more than one such end is reduced right after its views."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    cone, stack = set(), list(rows)
    while stack:
        for u in stack.pop().users:
            if u not in cone and u.op == "call_function" and u.target in _LINEAR_IN_FIRST | _SUMS | {
                    _aten.mul.Tensor, _aten.index_add.default}:
                cone.add(u)
                stack.append(u)
    partial = set(rows)
    for n in sorted(cone, key=order.__getitem__):
        if _keeps_partial(n, partial):
            partial.add(n)
    out = {}
    for r in rows:
        ends, seen, stack = set(), {r}, [r]
        while stack:
            n = stack.pop()
            if any(u not in partial for u in n.users):
                ends.add(n)
            for u in n.users:
                if u in partial and u not in seen:
                    seen.add(u)
                    stack.append(u)
        out[r] = next(iter(ends)) if len(ends) == 1 else _end_of_views(r)
    return out


def _end_of_views(n: torch.fx.Node) -> torch.fx.Node:
    """The last of the views that alone follow ``n``."""
    while len(n.users) == 1 and next(iter(n.users)).target in FEATURE_VIEWS:
        n = next(iter(n.users))
    return n
