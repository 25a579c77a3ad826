"""Expert parallelism on the traced step: each rank runs ``E / ep`` of a routed experts' block's
experts, on the tokens of every rank of its ``ep`` group routed to them.

The single-device step runs routed experts as ``grouped_mm`` calls over the block's
``tokens x top_k`` rows sorted by expert (``traceable.routed_experts_forward``), all calls of one
block sharing the rows' end offsets per expert. The distribute pass replays each such call here:

- **dispatch** (before the block's first grouped linears, once per input they share): each
  rank's rows are already in expert order, so the rows for rank ``j``'s experts are one
  contiguous run (3-D experts split over a multiple of the ep ranks: rank ``j`` owns a piece of
  each of several runs, and the rows are put in owner order first: ``_routing``). The per-expert counts are exchanged (an all-to-all of ``E`` integers), then the
  rows themselves (``all_to_all_single`` with the counts' sums as split sizes: data-dependent
  sizes, traced as unbacked symbolic sizes), and the rows received from the ``ep`` sources are
  reordered by local expert (a stable sort, so each expert's rows keep source order).
- the **experts** run on the received rows only. Where FSDP shards the experts' weights over
  exactly the ep ranks, each rank receives its own experts' whole weights (``owned_weights``: one
  all-to-all of shards per expert linear; experts held in one 3-D parameter, split along the
  experts, need none: each rank's shard *is* its experts', or a piece of them the rank's shard
  group gathers, ``stacked_weights``, ``assembled_stacked``); where FSDP
  shards them over a multiple of the ep ranks, the rest of each owned expert's shards are then
  gathered over the ``dp_shard / ep`` ranks holding them (torchtitan's ``dp_shard_mod_ep``) and runs
  ``grouped_mm`` over them alone; otherwise with
  every expert's (gathered or replicated) weight and end offsets in which the other ranks'
  experts own no rows (their gradients are zeros here; the owner computes them, and the
  data-parallel reduction sums them).
- **biases** (an expert's bias added to its rows, ``table[expert of row]``, between the block's
  calls): the rows' indices into the table travel with the rows (an all-to-all of one integer
  per row), and each received row takes its own entry (``received_index``). After the block's
  last calls the rows are back in token order, so a bias added there runs as on one process.
- **combine** (after the block's last grouped linears): the rows back in received order and to
  the ranks they came from (the reverse all-to-all); the model's own weighting and sum over
  each token's ``top_k`` rows then run as on one process.

Autograd runs through the same collectives, reversed. The ``ep`` group is carved out of the
data-parallel ranks (consecutive ranks of ``dp_replicate x dp_shard``, innermost first), so the
tokens of its ranks are different sequences and each expert sees them all, as torchtitan's and
Megatron-LM's expert parallelism do.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.distributed._functional_collectives as funcol
import torch.fx
import torch.fx.traceback as fx_traceback

from autopar.errors import AutoparError
from autopar.fxops import TYPICAL
from autopar.grouped_mm import GROUPED_MM, grouped_mm

# What the collectives and their reorders are annotated with (explain, the AC pass, inspect_graph).
WEIGHTS = "ep: experts' weight shards to the experts' ranks"
DISPATCH = "ep: routed rows to their experts' ranks"
COMBINE = "ep: expert outputs back to their tokens' ranks"


@dataclass
class EPGroup:
    """The ``ep`` process group of this rank (``size`` ranks, each owning ``E / size`` experts).
    ``owners_read``: the experts' weights are FSDP-sharded over these ranks or a multiple of them,
    so each rank receives its own experts' shards (``owned_weights``) instead of gathering every
    expert; ``shard_group``: over a multiple, this rank's group of the ``shard_size`` ranks of
    ``dp_shard`` at its place in their ep groups, which hold the rest of its experts' shards."""

    group_name: str
    size: int
    owners_read: bool = False
    shard_group: str = ""
    shard_size: int = 1


@dataclass
class _Block:
    """One routed experts' block (its grouped linears share one offsets node): which of its calls
    read dispatched rows (rows in token order) and which outputs are combined (the last linears)."""

    dispatched_inputs: set = field(default_factory=set)
    combined: set = field(default_factory=set)
    # How many pieces each rank's experts come in, one on each rank of its ``shard_group`` (3-D
    # experts FSDP-split along the experts over a multiple of the ep ranks: ``_routing``); 1: its
    # experts are one run of the expert order.
    chunks: int = 1
    routing: tuple | None = None  # ``_routing``'s, made at the block's first call
    offsets: dict = field(default_factory=dict)  # owned weights or not -> the grouped_mm's end offsets
    sent: dict = field(default_factory=dict)  # input node -> its rows on the experts' ranks
    # an add of a per-row table entry to a call's output inside the block -> (call, index node)
    biases: dict = field(default_factory=dict)
    tp_weights: dict = field(default_factory=dict)  # under TP: a call -> its weights' TP placement


def blocks(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, _Block]:
    """Each ``grouped_mm`` call of ``gm`` -> its block: the calls sharing an offsets node. A call
    reads dispatched rows where its input does not depend on another call of the block; its
    output is combined where no other call of the block depends on it."""
    by_offs: dict = {}
    for n in gm.graph.find_nodes(op="call_function", target=GROUPED_MM):
        by_offs.setdefault(n.args[2], []).append(n)
    out = {}
    pos = {n: i for i, n in enumerate(gm.graph.nodes)} if by_offs else {}
    for calls in by_offs.values():
        b = _Block()
        members = set(calls)
        for c in calls:
            if not _reaches(c, members - {c}, pos):
                b.combined.add(c)
            if not any(_reaches(o, {c}, pos) for o in members - {c}):
                b.dispatched_inputs.add(c)
        for c in calls:
            out[c] = b
            if c not in b.combined:
                for u in c.users:
                    pick = _table_rows(u, c)
                    if pick is not None:
                        b.biases[u] = (c, pick)
    return out


def _table_rows(u: torch.fx.Node, call: torch.fx.Node) -> torch.fx.Node | None:
    """For ``u`` = ``call``'s output plus ``table[index]`` (one integer index per row: an
    expert's bias for each of its rows, as the routed forms add it), that ``index`` node."""
    if u.target != torch.ops.aten.add.Tensor or len(u.args) != 2 or u.kwargs:
        return None
    other = u.args[1] if u.args[0] is call else u.args[0]
    if (isinstance(other, torch.fx.Node) and other is not call and other.target == torch.ops.aten.index.Tensor
            and len(other.args[1]) == 1 and isinstance(other.args[1][0], torch.fx.Node)):
        return other
    return None


def stacked_weights(call: torch.fx.Node) -> tuple | None:
    """For a grouped call whose weights are one 3-D parameter's experts in order (``unbind`` of a
    placeholder along dim 0, each piece as it is or transposed): (the ``unbind``, whether the
    pieces are transposed, the nodes from it to the weights); None where the weights are
    otherwise or those nodes feed anything else."""
    ws = list(call.args[1])
    pieces = [w.args[0] if w.target == torch.ops.aten.t.default else w for w in ws]
    flips = {w is not p for w, p in zip(ws, pieces)}
    if len(flips) != 1 or not all(p.target is operator.getitem for p in pieces):
        return None
    ub = pieces[0].args[0]
    if (ub.target != torch.ops.aten.unbind.int or (ub.args[1] if len(ub.args) > 1 else ub.kwargs.get("dim", 0)) != 0
            or ub.args[0].op != "placeholder" or [(p.args[0], p.args[1]) for p in pieces] != [(ub, i) for i in range(len(ws))]):
        return None
    chain = {ub, *pieces, *ws}
    if any(u not in chain and u is not call for x in chain for u in x.users):
        return None
    return ub, flips.pop(), chain


def _reaches(src: torch.fx.Node, targets: set, pos: dict) -> bool:
    """Whether a node of ``targets`` uses ``src``'s value, directly or through other nodes (only
    nodes before the last target, in graph order, can lead to one)."""
    end = max((pos[t] for t in targets), default=-1)
    seen, todo = set(), [src]
    while todo:
        x = todo.pop()
        for u in x.users:
            if u in targets:
                return True
            if u not in seen and pos[u] < end:
                seen.add(u)
                todo.append(u)
    return False


def _routing(offs: torch.Tensor, n_experts: int, rows: int, g: EPGroup, chunks: int = 1):
    """The block's dispatch: (rows this rank sends to each rank, rows it receives from each, the
    order that sorts the received rows by local expert, its inverse, the received rows per local
    expert, and the order that puts this rank's rows in their owners' order and its inverse, or
    None where the expert order is that already).

    Rank ``j`` of the ep group owns ``E / ep`` experts: the ``j``-th run of them, or, with
    ``chunks`` > 1 (3-D experts split along the experts over ``chunks x ep`` ranks of dp_shard,
    ``assembled_stacked``), the ``j``-th piece of each of ``chunks`` runs: what its shard group's
    ranks hold. The rows, sorted by expert, then go to their owners in owner order (a stable
    sort: each expert's rows keep their order)."""
    n, el = g.size, n_experts // g.size
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    regroup = None
    if chunks > 1:
        # owner order: expert (chunk c, owner j, k) at position (j, c, k)
        owner_order = torch.arange(n_experts, device=offs.device).view(chunks, n, el // chunks).transpose(0, 1).reshape(-1)
        place = owner_order.argsort()
        row_expert = torch.repeat_interleave(torch.arange(n_experts, device=offs.device), counts, output_size=rows)
        regroup = place[row_expert].argsort(stable=True)
        counts = counts[owner_order]
    # recv[j, e]: rows rank j sends to this rank's local expert e.
    recv = funcol.wait_tensor(funcol.all_to_all_single(counts, None, None, g.group_name)).view(n, el)
    with fx_traceback.annotate({TYPICAL: rows // n}):  # what a liveness walk takes: routing spread evenly
        send_sizes = counts.view(n, el).sum(1).tolist()
        recv_sizes = recv.sum(1).tolist()
    for s in (*send_sizes, *recv_sizes):
        torch._check(s >= 0)
    expert = torch.repeat_interleave(torch.arange(el, device=offs.device).repeat(n), recv.reshape(-1),
                                     output_size=sum(recv_sizes))
    order = expert.argsort(stable=True)
    return (send_sizes, recv_sizes, order, order.argsort(), recv.sum(0), regroup,
            None if regroup is None else regroup.argsort())


def _offsets_of_all(mine: torch.Tensor, g: EPGroup) -> torch.Tensor:
    """End offsets over all ``E`` experts of rows sorted by this rank's experts (``mine``: rows per
    local expert), the other ranks' experts owning none."""
    me = torch.ops.autopar.group_rank(mine, g.group_name)  # read at run time: every rank's graph the same
    here = (torch.arange(g.size, device=mine.device) == me).to(mine.dtype)
    return (here[:, None] * mine[None, :]).reshape(-1).cumsum(0)


def owned_weights(shards: list[torch.Tensor], g: EPGroup, dim: int) -> list[torch.Tensor]:
    """This rank's ``E / ep`` experts' whole weights from every expert's shard along ``dim`` on
    each rank of ``dp_shard`` (FSDP over the ep ranks or a multiple of them): one all-to-all over
    the ep group, each rank sending each owner its shards of that owner's experts, then, over a
    multiple, the ``shard_size`` pieces of them gathered from the ranks at this rank's place in the
    other ep groups (``1 / ep`` of the bytes an FSDP gather of every expert moves). Backward: the
    gradients reduced over those ranks (each owner computed its own ep group's share), then each
    rank sent its shard of them back; only owners compute an expert's gradient."""
    stacked = torch.stack(shards)  # (E, *shard): the experts in owner order
    got = funcol.all_to_all_single_autograd(stacked, None, None, g.group_name)
    if g.shard_size > 1:
        got = funcol.all_gather_single_autograd(got, 0, g.shard_group)
    return assembled(got, g.size * g.shard_size, dim)


def assembled(got: torch.Tensor, n: int, dim: int) -> list[torch.Tensor]:
    """This rank's experts' whole weights from what ``owned_weights``' collectives received from
    ``n`` shards' ranks: ``got[source * E/n + k]``, the shard along ``dim`` of its k-th expert that
    rank ``source`` of ``dp_shard`` holds (over a multiple of the ep ranks, ``source`` is ``place
    in the other ep groups * ep + place in the ep group``: dp_shard's order)."""
    el, piece = got.shape[0] // n, list(got.shape[1:])
    whole = [*piece[:dim], n * piece[dim], *piece[dim + 1:]]
    return list(got.view(n, el, *piece).movedim(0, 1 + dim).reshape(el, *whole).unbind(0))


def assembled_stacked(local: torch.Tensor, g: EPGroup) -> torch.Tensor:
    """This rank's experts of a 3-D parameter (experts along dim 0) from its FSDP shard: over
    exactly the ep ranks the shard itself; over ``shard_size`` times as many, the pieces the ranks
    of its shard group hold, gathered (chunk ``c`` of ``E / (ep x shard_size)`` experts lives on
    dp_shard rank ``c``: this rank's group holds chunks ``q x ep + j``, which ``_routing`` with
    ``chunks`` gives rank ``j``). Backward: the gradients reduce-scattered over that group."""
    if g.shard_size == 1:
        return local
    return funcol.all_gather_single_autograd(local, 0, g.shard_group)


def received_index(idx: torch.Tensor, src: torch.fx.Node, b: _Block, g: EPGroup) -> torch.Tensor:
    """Integer values of this rank's rows (``idx``, in its row order) as the rows its experts
    received carry them: sent along the rows' own all-to-all routes, then in local expert order
    (once per block and index node ``src``)."""
    if src not in b.sent:
        send, recv, order = b.routing[:3]
        regroup = b.routing[5]
        with fx_traceback.annotate({"pass": "ep", "why": DISPATCH}):
            idx = idx if regroup is None else idx[regroup]
            b.sent[src] = funcol.wait_tensor(funcol.all_to_all_single(idx, recv, send, g.group_name))[order]
    return b.sent[src]


def grouped(n: torch.fx.Node, args: tuple, b: _Block, g: EPGroup, owned: list | None = None) -> torch.Tensor:
    """The replay of ``grouped_mm`` call ``n`` of block ``b`` under expert parallelism; ``owned``:
    this rank's experts' whole weights (``owned_weights``), else ``args`` hold every expert's."""
    x, ws, offs = args
    if b.routing is None:
        with fx_traceback.annotate({"pass": "ep", "why": DISPATCH}):
            b.routing = _routing(offs, len(n.args[1]), x.shape[0], g, b.chunks)
    send, recv, order, inverse, mine, regroup, ungroup = b.routing
    if b.chunks > 1 and owned is None:
        raise AutoparError(f"expert parallelism: {n.name} reads every expert's weights in a block whose 3-D "
                           f"experts each rank reads only its own of; turn off FSDP or make dp_shard equal ep")
    if n in b.dispatched_inputs:
        src = n.args[0]
        if src not in b.sent:
            with fx_traceback.annotate({"pass": "ep", "why": DISPATCH}):
                rows = x if regroup is None else x[regroup]
                b.sent[src] = funcol.all_to_all_single_autograd(rows, recv, send, g.group_name)[order]
        x = b.sent[src]
    key = owned is not None
    if key not in b.offsets:
        b.offsets[key] = mine.cumsum(0) if key else _offsets_of_all(mine, g)
    y = grouped_mm(x, owned if key else list(ws), b.offsets[key])
    if n in b.combined:
        with fx_traceback.annotate({"pass": "ep", "why": COMBINE}):
            y = funcol.all_to_all_single_autograd(y[inverse], send, recv, g.group_name)
            y = y if ungroup is None else y[ungroup]
    return y
