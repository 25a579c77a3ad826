"""The distribute pass: the single-device step graph becomes the parallel joint graph.

An interpreter replays the single-device forward graph under ``make_fx`` on the rank's local
tensors, with every parameter read through ``fsdp.read_param`` (its data-parallel gather) and,
under TP or CP, wrapped as a DTensor on the mesh of those dims (``cp.ActMesh``) with its TP
placement from ``tp.tp_rules`` (whole on cp; ``passes/cp.py`` splits the sequence). Each
op then runs as a DTensor op, so activation placements follow by DTensor's sharding
propagation, and the shapes baked into the graph (views, expands, head counts) are global shapes
that DTensor turns into local ones. At the nodes the TP rules name, the value is redistributed
(column inputs gathered once, row outputs reduced to the residual placement, the logits
gathered). A fused projection's output, split into its equal parts (``split``/``chunk``/``slice``
of an interleaved ``_StridedShard``, or its view as stacked parts), is split locally: each part
is then an ordinary ``Shard``.
The gradients are taken by autograd, through DTensor, inside the same trace, so the result is
one joint graph ``(primals, tangents) -> (outputs, gradients)`` on local tensors with every
collective an explicit ``_c10d_functional`` op. Where DTensor would write the rank's coordinate
into the graph (a vocabulary shard's offset, the chunk a rank keeps), it is read at run time
instead (``passes/coords.py``): the TP ranks' graphs are the same and compile once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from dataclasses import dataclass, field

import torch
import torch.fx.traceback as fx_traceback
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor.parallel import loss_parallel
from torch.distributed.tensor.placement_types import _StridedShard
from torch.fx.experimental.proxy_tensor import make_fx

from autopar import passes
from autopar.errors import AutoparError
from autopar.fxops import ATTENTION_OPS, SPLIT_OPS, ZEROS, mutates, out_of_place
from autopar.grouped_mm import GROUPED_MM, grouped_mm
from autopar.passes import GATHERED_INPUT, coords, cp, dtensor_rules, stamp  # noqa: F401  (registers sharding rules)
from autopar.passes import ep as ep_pass
from autopar.passes.cp import ActMesh
from autopar.passes.fsdp import read_param, replicated
from autopar.passes.tp import TPRules

_aten = torch.ops.aten
log = logging.getLogger(__name__)


@dataclass
class Layout:
    """Where each parameter of the step lives: TP placement on the ``tp`` dim, data-parallel
    placement on ``dp_shard`` (replicated on ``dp_replicate``). ``param_mesh`` holds the mesh
    dims of size > 1 among (dp_replicate, dp_shard, tp); None on one process."""

    shapes: list  # global shapes, by parameter index
    tp: dict
    dp: dict
    param_mesh: object = None
    param_dims: tuple = ()
    tp_mesh: object = None
    act_mesh: ActMesh | None = None  # the replay's DTensor mesh: its cp and tp dims (size > 1)
    dp_mesh: object = None
    dp_dims: tuple = ()
    dp_submeshes: dict = field(default_factory=dict)  # fsdp.sub_meshes(dp_mesh), sliced before tracing
    dp_size: int = 1
    ep: ep_pass.EPGroup | None = None  # expert parallelism: this rank's ep group (passes/ep.py)
    # Mixed precision: each parameter is read in ``compute`` dtype (cast before its gather) and
    # its gradient reduced in ``reduce`` dtype; None: the parameters' own dtype throughout.
    compute: torch.dtype | None = None
    reduce: torch.dtype | None = None
    # FSDP once per step (``Plan.fsdp_once``): the step graph takes each parameter whole (its TP
    # shard, in the compute dtype), gathered before the step by the runtime (``zero.py``), and
    # returns its gradient unreduced; ``dp_mesh`` is then the runtime's, not the graph's.
    once: bool = False

    def placements(self, i: int) -> tuple:
        by_dim = {"dp_replicate": Replicate(), "dp_shard": self.dp[i], "dp_shard_cp": self.dp[i],
                  "tp": self.tp.get(i, Replicate())}
        return tuple(by_dim[d] for d in self.param_dims)

    def tp_local_shape(self, i: int) -> tuple:
        shape = list(self.shapes[i])
        p = self.tp.get(i)
        if self.tp_mesh is not None and isinstance(p, Shard):
            shape[p.dim] //= self.tp_mesh.size()
        return tuple(shape)

    def dp_placements(self, i: int) -> list:
        return [Replicate() if d == "dp_replicate" else self.dp[i] for d in self.dp_dims]

    def owned_dim(self, indices: list[int]) -> int | None:
        """The dim along which FSDP splits one grouped linear's expert weights (parameters
        ``indices``) where each ep rank reads only its own experts' (``ep.owned_weights``): they
        are alike, split along one dim evenly over ``dp_shard`` (the ep ranks or a multiple of
        them), placed alike by TP; else None."""
        if self.ep is None or not self.ep.owners_read:
            return None
        shapes = [self.tp_local_shape(i) for i in indices]
        dims = {self.dp[i].dim if isinstance(self.dp[i], Shard) else None for i in indices}
        (dim,) = dims if len(dims) == 1 else (None,)
        shards = self.ep.size * self.ep.shard_size
        if dim is None or any(shape[dim] % shards or shape != shapes[0] for shape in shapes) or len(
                {self.tp.get(i) for i in indices}) != 1:
            return None
        return dim

    def owned_experts(self, sg) -> list[tuple[tuple[int, ...], int]]:
        """Step graph ``sg``'s grouped linears whose expert weights each ep rank reads only its
        own of: (their parameter indices, the dim FSDP splits them along)."""
        place = {ph: i for i, ph in enumerate(sg.placeholders()[:sg.n_params])}
        out = {}
        for n in ep_pass.blocks(sg.gm):
            idx = tuple(place.get(w, -1) for w in n.args[1])
            if idx not in out and -1 not in idx and (dim := self.owned_dim(list(idx))) is not None:
                out[idx] = dim
        return list(out.items())

    def owned_stacked(self, sg) -> list[int]:
        """Step graph ``sg``'s 3-D expert parameters (every expert's weight of a grouped linear,
        ``ep_pass.stacked_weights``) that each ep rank reads only its own experts of: split along
        the experts over the ep ranks or a multiple of them (``ep_pass.assembled_stacked``)."""
        place = {ph: i for i, ph in enumerate(sg.placeholders()[:sg.n_params])}
        out = []
        for n in ep_pass.blocks(sg.gm):
            found = ep_pass.stacked_weights(n)
            i = place.get(found[0].args[0], -1) if found is not None else -1
            if i >= 0 and i not in out and self.owned_dim([i]) == 0:
                out.append(i)
        return out


class Unread:
    """A parameter not read yet: ``replay`` reads it (``read(consumer_node)``) at its first use,
    so its data-parallel gather lands in the graph where the parameter is first needed, and
    autograd, which runs later-created nodes first, reduces its gradient as soon as it is complete."""

    def __init__(self, read, index: int = -1, local: torch.Tensor | None = None):
        self.read, self.index, self.local = read, index, local


class _Shard(torch.autograd.Function):
    """``x.to_local()`` whose gradient comes back as a DTensor with ``x``'s own spec. DTensor's
    ``to_local`` remakes the gradient with ``from_local``, which reads a ``_StridedShard`` as a
    shard order (no ``shard_order``), while the same placement made by a view (heads folded into
    the batch dim) carries one: DTensor then prices keeping the placement at an infinite cost and
    gathers both operands of the backward's batched matmul (every head's attention probabilities
    and values, on every rank) instead of running it on each rank's heads."""

    @staticmethod
    def forward(ctx, x: DTensor) -> torch.Tensor:
        ctx.spec = x._spec
        return x._local_tensor.view_as(x._local_tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _with_spec(grad, ctx.spec)


def _with_spec(local: torch.Tensor, spec) -> DTensor:
    """``local`` as this rank's shard of a DTensor with ``spec`` (its placements, and its shard
    order as the spec carries it), the global strides those of ``local``."""
    import dataclasses

    from torch.distributed.tensor._dtensor_spec import TensorMeta
    from torch.distributed.tensor._utils import compute_global_tensor_info

    _, stride = compute_global_tensor_info(local, spec.mesh, spec.placements)
    meta = TensorMeta(spec.tensor_meta.shape, tuple(stride), spec.tensor_meta.dtype)
    return DTensor(local, dataclasses.replace(spec, tensor_meta=meta), requires_grad=local.requires_grad)


def _interleaved(x: DTensor, am: ActMesh) -> _StridedShard | None:
    """``x``'s TP placement where it is an interleave (``_StridedShard``) that only TP splits:
    a fused output's parts, each holding this rank's heads. Not where another mesh dim splits the
    same dim (the tokens of a flattened (batch, sequence) under SP, split over cp and tp too):
    DTensor views that itself."""
    p = am.tp_of(x)
    if not isinstance(p, _StridedShard):
        return None
    i = am.names.index("tp")
    if any(j != i and isinstance(q, (Shard, _StridedShard)) and q.dim % x.dim() == p.dim % x.dim()
           for j, q in enumerate(x.placements)):
        return None
    return p


def _local_split(x: DTensor, n: torch.fx.Node, args: tuple, am: ActMesh) -> list | None:
    """Split an interleaved (``_StridedShard``) fused output into its parts locally."""
    p = _interleaved(x, am)
    if p is None:
        return None
    dim = args[2] if len(args) > 2 else n.kwargs.get("dim", 0)
    if dim % x.dim() != p.dim % x.dim():
        return None
    parts = len(n.meta["val"])
    if parts != p.split_factor:
        return None
    local = _Shard.apply(x)
    return [DTensor.from_local(c.contiguous(), am.mesh, am.with_tp(x, Shard(p.dim)), run_check=False, shape=v.shape,
                               stride=_contiguous_stride(v.shape))
            for c, v in zip(local.chunk(parts, dim), n.meta["val"])]


def _local_view(x: DTensor, n: torch.fx.Node, am: ActMesh):
    """View an interleaved (``_StridedShard``) fused output as its stacked parts, (..., A, heads,
    head_dim) with ``A`` the parts at the sharded dim: each rank's shard holds its heads of every
    part, so the local view is the same with heads divided, sharded on the heads dim."""
    p = _interleaved(x, am)
    if p is None:
        return None
    v = n.meta["val"]
    dim = p.dim % x.dim()
    tp = am.size("tp")
    if (tuple(v.shape[:dim]) != tuple(x.shape[:dim]) or v.dim() < dim + 3 or v.shape[dim] != p.split_factor
            or v.shape[dim + 1] % tp):
        return None
    local = [*x._local_tensor.shape[:dim], *v.shape[dim:]]  # the leading dims as split (cp's sequence)
    local[dim + 1] //= tp
    return DTensor.from_local(_Shard.apply(x).contiguous().view(local), am.mesh, am.with_tp(x, Shard(dim + 1)), run_check=False,
                              shape=v.shape, stride=_contiguous_stride(v.shape))


def _unflattened_tokens(x: DTensor, n: torch.fx.Node, am: ActMesh):
    """Tokens flattened as (batch x sequence, ...) viewed back as (batch, sequence, ...) where
    more than one mesh dim splits the sequence (cp and tp's SP: each ``_StridedShard(0, batch)``):
    locally the same view with this rank's tokens, the sequence split as before the flatten.
    DTensor cannot unflatten two interleaves of one dim (DeepSeek-V2's replicated latent
    projection under CP x TP + SP, which runs on each rank's tokens)."""
    v = n.meta["val"]
    split = [i for i, q in enumerate(x.placements) if not q.is_replicate()]
    if (len(split) < 2 or v.dim() != x.dim() + 1 or tuple(v.shape[2:]) != tuple(x.shape[1:])
            or v.shape[0] * v.shape[1] != x.shape[0]):
        return None
    if not all(isinstance(x.placements[i], _StridedShard) and x.placements[i].dim % x.dim() == 0
               and x.placements[i].split_factor == v.shape[0] for i in split):
        return None
    local = _Shard.apply(x)
    placements = tuple(Shard(1) if i in split else q for i, q in enumerate(x.placements))
    return DTensor.from_local(local.contiguous().view(v.shape[0], -1, *v.shape[2:]), x.device_mesh, placements,
                              run_check=False, shape=v.shape, stride=_contiguous_stride(v.shape))


class _FlatTokens(torch.autograd.Function):
    """DTensor's own flatten of (batch, sequence, ...) split along the sequence by more than one
    mesh dim, whose gradient is unflattened locally (``_unflattened_tokens``' view, backward)."""

    @staticmethod
    def forward(ctx, x: DTensor, shape) -> DTensor:
        out = x.view(shape)
        ctx.spec, ctx.local_shape, ctx.out_placements = x._spec, x._local_tensor.shape, out.placements
        return out

    @staticmethod
    def backward(ctx, grad: DTensor):
        if grad.placements != ctx.out_placements:  # laid out as the flattened value, rank by rank
            grad = grad.redistribute(grad.device_mesh, ctx.out_placements)
        return _with_spec(grad._local_tensor.contiguous().view(ctx.local_shape), ctx.spec), None


def _flattened_tokens(x: DTensor, n: torch.fx.Node, am: ActMesh):
    """(batch, sequence, ...) viewed as (batch x sequence, ...) where more than one mesh dim splits
    the sequence: DTensor's view, with the gradient viewed back locally (``_FlatTokens``)."""
    v = n.meta["val"]
    split = [i for i, q in enumerate(x.placements) if not q.is_replicate()]
    if (len(split) < 2 or x.dim() < 2 or v.dim() != x.dim() - 1 or tuple(v.shape[1:]) != tuple(x.shape[2:])
            or not all(isinstance(x.placements[i], Shard) and x.placements[i].dim % x.dim() == 1 for i in split)):
        return None
    return _FlatTokens.apply(x, tuple(v.shape))


def _on_whole_values(target, args, kwargs, am: ActMesh):
    """An op DTensor has no sharding rule for (the in-place restride in an adaptive pool's
    decomposition: Swin's pooler): run on whole values, the same on every rank, its output replicated."""
    inplace = getattr(target, "_schema", None) is not None and target._schema.is_mutable

    def whole(a):  # an in-place op gets a copy: autograd forbids changing to_local's view in place
        if not isinstance(a, DTensor):
            return a
        local = a.redistribute(a.device_mesh, [Replicate()] * a.device_mesh.ndim).to_local()
        return local.clone() if inplace else local

    out = target(*pytree.tree_map(whole, args), **pytree.tree_map(whole, kwargs))
    return pytree.tree_map(lambda o: DTensor.from_local(o, am.mesh, am.placements(), run_check=False)
                           if isinstance(o, torch.Tensor) else o, out)


def _contiguous_stride(shape) -> tuple:
    return torch.empty(shape, device="meta").stride()


def _local_slice(x: DTensor, n: torch.fx.Node, args: tuple, am: ActMesh):
    p = _interleaved(x, am)
    if p is None:
        return None
    _, dim, start, end = (list(args) + [0, None, None])[:4]
    size = x.shape[dim]
    part = size // p.split_factor
    end = size if end is None or end > size else end
    if dim % x.dim() != p.dim % x.dim() or start % part or end - start != part:
        return None
    local = _Shard.apply(x)
    lp = local.shape[dim] // p.split_factor
    k = start // part
    piece = local.narrow(dim, k * lp, lp).contiguous()
    v = n.meta["val"]
    return DTensor.from_local(piece, am.mesh, am.with_tp(x, Shard(p.dim)), run_check=False, shape=v.shape,
                              stride=_contiguous_stride(v.shape))


# ``_vocab_embedding``'s output is partial over tp, and its gradient must reach each rank whole:
# ``from_local`` hands a partial value's gradient on as Replicate where torch normalises gradient
# placements (2.13 does); before, it divided it over the ranks (then DTensor's own op runs).
_PARTIAL_GRAD_WHOLE = hasattr(torch.distributed.tensor._api, "_normalize_placements_for_grad")


class _VocabRows(torch.autograd.Function):
    """An embedding lookup on one TP rank's rows ``[start, start + rows)`` of a table split along
    the vocabulary (Megatron-LM's vocabulary-parallel embedding): ids outside them read row 0
    and give zeros (the TP ranks' outputs sum to the lookup); the backward scatters the gradient
    of this rank's ids into its own rows only. DTensor's op makes the whole table's gradient on
    every rank and then keeps a chunk of it: tp times the memory and the scatter's work."""

    @staticmethod
    def forward(ctx, weight, ids, start, padding_idx):
        rows = weight.shape[0]
        local, outside = coords.own_rows(ids, start, rows)
        out = _aten.embedding.default(weight, local).masked_fill(outside.unsqueeze(-1), 0)
        # the rows that get no gradient: other ranks' ids, and the padding id (as ``padding_idx``)
        ctx.save_for_backward(local, outside if padding_idx < 0 else outside | (ids == padding_idx))
        ctx.rows = rows
        return out

    @staticmethod
    def backward(ctx, grad):
        local, skip = ctx.saved_tensors
        grad = grad.masked_fill(skip.unsqueeze(-1), 0)
        return _aten.embedding_dense_backward.default(grad, local, ctx.rows, -1, False), None, None, None


def _vocab_embedding(args: tuple, kwargs: dict, am: ActMesh) -> DTensor | None:
    """``aten.embedding`` of a table split evenly along the vocabulary over tp (``_VocabRows``),
    its output partial over tp (summed where it becomes the residual stream); None where the
    table is split otherwise or the call scales gradients by frequency or is sparse."""
    a = dict(zip(("weight", "indices", "padding_idx", "scale_grad_by_freq", "sparse"), args), **kwargs)
    w, ids = a["weight"], a["indices"]
    if not _PARTIAL_GRAD_WHOLE or a.get("scale_grad_by_freq") or a.get("sparse") or not isinstance(w, DTensor):
        return None
    n = am.size("tp")
    split_rows = am.tp_of(w) == Shard(0) and not w.shape[0] % n
    if not split_rows or any(not p.is_replicate() for d, p in zip(am.names, w.placements) if d != "tp"):
        return None
    dim = am.names.index("tp")
    ids_local = ids.to_local() if isinstance(ids, DTensor) else ids
    r = coords.run_time_rank(ids_local, am.mesh, dim)
    start = (coords.coordinate(am.mesh, dim) if r is None else r) * (w.shape[0] // n)
    # Each cp rank looks up its own tokens: its gradient of the table is a partial sum over cp.
    cp_split = isinstance(ids, DTensor) and am.has("cp") and not ids.placements[am.names.index("cp")].is_replicate()
    grad = am.placements(tp=Shard(0), cp=Partial()) if cp_split else None
    pad = a.get("padding_idx")
    out = _VocabRows.apply(w.to_local(grad_placements=grad), ids_local, start, -1 if pad is None else int(pad))
    placements = am.with_tp(ids, Partial()) if isinstance(ids, DTensor) else am.placements(tp=Partial())
    shape = torch.Size((*ids.shape, w.shape[1]))
    return DTensor.from_local(out, am.mesh, placements, run_check=False, shape=shape,
                              stride=_contiguous_stride(shape))


def _grouped_linear(args: tuple, am: ActMesh, pick=None) -> DTensor | None:
    """Routed experts' ``grouped_mm`` with every expert's weight split alike over tp, run on the
    local shards: a column's (``Shard(0)``: output features) reads the rows whole and gives its
    output features' shard; a row's (``Shard(1)``: input features) reads its feature shard of the
    rows and gives a partial sum (reduced where it becomes the residual). ``pick``: for a column
    whose rows are picked from the token matrix ``args[0]`` (the tokens in expert order), the
    row indices: the pick runs locally too, so the input gradient stays a partial sum through it
    and is reduced once, over the tokens (where they were gathered), not over tokens x top_k rows.
    None where the weights are placed otherwise (replicated: DTensor's whole-value fallback runs it)."""
    x, ws, offs = args
    if not am.has("tp"):
        return None
    pls = {am.tp_of(w) for w in ws if isinstance(w, DTensor)}
    if len(pls) != 1 or len(ws) != sum(isinstance(w, DTensor) for w in ws):
        return None
    (pw,) = pls
    # A fused column (gate and up in one weight) is split in interleaved parts: its output too.
    column = isinstance(pw, (Shard, _StridedShard)) and pw.dim == 0
    if not (column or pw == Shard(1)) or any(not p.is_replicate() for d, p in zip(am.names, ws[0].placements) if d != "tp"):
        return None
    if pick is not None and not column:
        return None
    offs_local = _whole_local(offs, am)
    local_ws = [w.to_local() for w in ws]
    if column:
        rows = _rows_whole(x, am)
        if pick is not None:
            rows = rows[_whole_local(pick, am)]
        out = grouped_mm(rows, local_ws, offs_local)
        pl = am.placements(tp=_StridedShard(1, split_factor=pw.split_factor) if isinstance(pw, _StridedShard) else Shard(1))
    else:
        rows = _placed(x, am, am.placements(tp=Shard(1))).to_local()
        out = grouped_mm(rows, local_ws, offs_local)
        pl = am.placements(tp=Partial())
    shape = torch.Size((rows.shape[0], ws[0].shape[0]))
    return DTensor.from_local(out, am.mesh, pl, run_check=False, shape=shape, stride=_contiguous_stride(shape))


def _placed(t: DTensor, am: ActMesh, pl) -> DTensor:
    """``t`` with placements ``pl`` (a redistribute to the same placements would still reduce a
    partial gradient)."""
    return t if tuple(t.placements) == tuple(pl) else t.redistribute(am.mesh, pl)


def _whole_local(t, am: ActMesh):
    """A DTensor as its whole value on this rank; anything else as it is."""
    return _placed(t, am, am.placements()).to_local() if isinstance(t, DTensor) else t


def _rows_whole(x, am: ActMesh) -> torch.Tensor:
    """A column's input rows whole on this rank, their gradient a partial sum over tp (each rank's
    feature shard's), reduced where the rows were gathered."""
    if not isinstance(x, DTensor):
        return x
    return _placed(x, am, am.placements()).to_local(grad_placements=am.placements(tp=Partial()))


def _split_feature_shard(n: torch.fx.Node, args: tuple, am: ActMesh) -> list | None:
    """A split of routed rows that stay local between expert parallelism's grouped calls
    (``_expert_parallel_tp``) along their features, which TP split (a fused gate/up column's
    output, each rank holding its share of every part): the traced sizes divided by tp."""
    x, sizes, dim = args[0], args[1], (args[2] if len(args) > 2 else n.kwargs.get("dim", 0))
    whole = n.args[0].meta["val"].shape[dim]
    tp = am.size("tp") if am.has("tp") else 1
    if tp == 1 or isinstance(x.shape[dim], torch.SymInt) or x.shape[dim] * tp != whole:  # not the rows (routed sizes)
        return None
    sizes = [s // tp for s in sizes] if isinstance(sizes, (list, tuple)) else sizes // tp
    return n.target(x, sizes, dim)


def _expert_parallel_tp(n: torch.fx.Node, args: tuple, b, ep: ep_pass.EPGroup, owned, am: ActMesh, tokens):
    """A routed experts' grouped linear under expert parallelism and TP: ``ep_pass.grouped`` on
    this rank's TP shards. A call reading rows in token order takes them whole on tp (from the
    gathered ``tokens`` picked locally when ``tokens`` = (tokens, row indices), so the input
    gradient stays a partial sum and is reduced once over the tokens, as ``_grouped_linear``); a
    call reading an earlier call's output reads its local feature shard. Between the calls the
    experts' rows stay local tensors (their sizes are the routing's); the block's last calls give
    their combined rows back as a DTensor: partial sums for a row linear (``Shard(1)`` weight),
    the feature shard for a column. ``owned``: (this rank's experts' TP-local weights, their TP
    placement), else ``args`` hold every expert's weight as a DTensor."""
    x, ws, offs = args
    weights, pw = owned if owned is not None else ([w.to_local() for w in ws], am.tp_of(ws[0]))
    if n in b.dispatched_inputs:
        rows = _rows_whole(tokens[0], am)[_whole_local(tokens[1], am)] if tokens is not None else _rows_whole(x, am)
    else:
        rows = x.to_local() if isinstance(x, DTensor) else x
    y = ep_pass.grouped(n, (rows, weights, _whole_local(offs, am)), b, ep, weights if owned is not None else None)
    if n not in b.combined:
        b.tp_weights[n] = pw
        return y
    pl = am.placements(tp=Partial() if pw == Shard(1) else Shard(1))
    shape = n.meta["val"].shape
    return DTensor.from_local(y, am.mesh, pl, run_check=False, shape=shape, stride=_contiguous_stride(shape))


def _expert_placement(pl, transposed: bool):
    """The TP placement of one expert's matrix of a 3-D parameter placed ``pl`` (experts on dim
    0), as it is or transposed."""
    if not isinstance(pl, Shard):  # (``_StridedShard`` is a Shard)
        return pl
    d = pl.dim - 1
    d = 1 - d if transposed else d
    return _StridedShard(d, split_factor=pl.split_factor) if isinstance(pl, _StridedShard) else Shard(d)


def _expert_bias(n: torch.fx.Node, b, ep: ep_pass.EPGroup, am: ActMesh | None, env: dict, arg) -> torch.Tensor:
    """``n``: a routed call's output plus a table's entry per row (an expert's bias) between the
    calls of expert-parallel block ``b``: the entries of the rows this rank's experts received
    (``ep_pass.received_index``), under TP the call's local feature shard of them (a column's:
    its output features' shard; replicated weights: every feature)."""
    call, index = b.biases[n]
    table, idx = arg(index.args[0]), arg(index.args[1][0])
    if isinstance(table, DTensor):
        pw = b.tp_weights.get(call, Replicate())
        if not (pw.is_replicate() or pw == Shard(0)):
            raise AutoparError(f"expert parallelism with TP: {n.name} adds a per-expert table to the rows of "
                               f"{call.name}, whose weights are placed {pw}: only a column's (split along its output "
                               "features) or replicated weights' rows take it; choose tp=1 or ep=1")
        table = _placed(table, am, am.with_tp(table, Shard(1) if pw == Shard(0) else Replicate())).to_local()
        idx = _whole_local(idx, am)
    return env[call] + table[ep_pass.received_index(idx, index.args[1][0], b, ep)]


def _scaled_partial(args: tuple, am: ActMesh) -> DTensor | None:
    """A partial sum over tp times a smaller replicated value (routed experts' rows by their
    routing weights, a shared expert's output by its gate): the scale's gradient, a partial sum of
    the scale's size, is all-reduced where it is made. Left to DTensor it is scattered over tokens,
    and the router's backward runs on token shards whose input gradient is gathered again."""
    a, b = args
    if not (isinstance(a, DTensor) and isinstance(b, DTensor) and am.has("tp")):
        return None
    p, r = (a, b) if am.tp_of(a).is_partial() else (b, a)
    if not (am.tp_of(p).is_partial() and am.tp_of(r).is_replicate() and r.requires_grad and r.numel() < p.numel()):
        return None
    r = _gradient_reduced_here(r)
    return p * r if p is a else r * p


def _added_rows_partial(n: torch.fx.Node, args: tuple, am: ActMesh) -> DTensor | None:
    """``index_add`` of routed experts' rows (partial sums over tp, a row linear's) onto fresh
    zeros, each row onto its token (experts held as 3-D parameters combine so): run on the local
    rows, its output a partial sum of every token, reduced once where it meets the residual
    stream, as a dense row's output is (not the rows reduced, then the tokens gathered to add them)."""
    base, dim, idx, src = args[:4]
    if (len(args) > 4 or n.kwargs or not isinstance(src, DTensor) or not am.has("tp") or not am.tp_of(src).is_partial()
            or any(not p.is_replicate() for d, p in zip(am.names, src.placements) if d != "tp")
            or not (isinstance(n.args[0], torch.fx.Node) and n.args[0].target in ZEROS)):
        return None
    rows = src.to_local(grad_placements=am.placements())  # a partial sum's gradient: the whole one
    out = torch.zeros(base.shape, dtype=base.dtype, device=rows.device).index_add(dim, _whole_local(idx, am), rows)
    return DTensor.from_local(out, am.mesh, am.placements(tp=Partial()), run_check=False, shape=out.shape,
                              stride=out.stride())


def _gradient_reduced_here(x: DTensor) -> DTensor:
    """``x`` (replicated) as it is, with its gradient made replicated where it arrives: a partial
    gradient is all-reduced there (``from_local``'s backward), not left for later ops to place."""
    return DTensor.from_local(x.to_local(), x.device_mesh, x.placements, run_check=False, shape=x.shape,
                              stride=x.stride())


def _picked_tokens(n: torch.fx.Node):
    """For a ``grouped_mm`` whose rows are ``tokens[idx]`` (one index on dim 0): (tokens, idx)."""
    a = n.args[0]
    if (isinstance(a, torch.fx.Node) and a.op == "call_function" and a.target == _aten.index.Tensor
            and len(a.args[1]) == 1 and isinstance(a.args[1][0], torch.fx.Node)):
        return a.args[0], a.args[1][0], a
    return None


def replay(gm: torch.fx.GraphModule, values: list, rules: TPRules | None, am: ActMesh | None, sp: bool,
           send_seq: int | None = None, ep: ep_pass.EPGroup | None = None, read_experts=None, watch=None) -> list:
    """Run ``gm``'s nodes on ``values`` (DTensors on ``am`` where TP or CP applies),
    redistributing as ``rules`` say; attention and the mean loss over split sequences as ``cp`` does;
    routed experts over the ``ep`` group as ``passes/ep.py`` does (``read_experts``: unread expert
    weights -> this rank's experts' whole weights, or None where they are read one by one).
    The outputs come back whole, or with ``send_seq`` (a pipeline stage's under CP) split along
    a sequence of that length as ``cp.sent`` sends them. ``watch(node, value)`` sees each
    node's value as it is made (``stamp.Recorder``)."""
    env: dict = {}
    gathered: dict = {}
    phs = iter(values)
    act = Shard(1) if sp else Replicate()
    split_seq = am is not None and am.has("cp")
    expert_blocks = ep_pass.blocks(gm) if ep is not None else {}
    bias_adds = {u: b for b in expert_blocks.values() for u in b.biases}
    # Experts in one 3-D parameter: at its unbind, this rank's shard may be its experts' weights.
    stacked = {}  # unbind of a 3-D weight -> (its call, pieces transposed, the nodes to the call)
    for c in expert_blocks if read_experts is not None else ():
        if (found := ep_pass.stacked_weights(c)) is not None:
            unbind, transposed, chain = found
            stacked[unbind] = (c, transposed, chain)
    skipped: set = set()  # the unbind and pieces of a parameter whose shard is this rank's experts
    owned: dict = {}  # a grouped linear's weights -> this rank's experts' whole weights

    def to_tp(x, p):
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, am.mesh, am.placements(), run_check=False)
        if am.tp_of(x) != p:
            if sp and p == Shard(1) and x.dim() < 2:
                return x
            x = x.redistribute(am.mesh, am.with_tp(x, p))
        return x

    def gather(x):
        """A column group's input, whole on every TP rank. Its gradient (partial sums from the
        column linears) is reduced here, once: a reduce-scatter back to sequence shards under SP,
        else an all-reduce (Megatron's f), which ``from_local`` of a replicated value does."""
        if isinstance(x, DTensor) and not am.tp_of(x).is_replicate():
            return to_tp(x, Replicate())  # backward: reduce-scatter
        return _gradient_reduced_here(to_tp(x, Replicate()))

    def arg(a, node):
        if isinstance(env[a], Unread):  # a parameter's first use: gather it here
            env[a] = env[a].read(node)
        if rules is not None and a in rules.gathered and node in rules.gathered[a]:
            if a not in gathered:
                # In its first reader's layer, so that under AC the backward gathers it again
                # (as Megatron-LM's SP does) instead of keeping the whole sequence.
                layer = {"layer": node.meta["custom"]["layer"]} if "layer" in node.meta.get("custom", {}) else {}
                with fx_traceback.annotate({"pass": "tp", "source": a.name, "why": GATHERED_INPUT, **layer}):
                    gathered[a] = gather(env[a])
            return gathered[a]
        return env[a]

    for n in gm.graph.nodes:
        if n.op == "placeholder":
            env[n] = next(phs)
            continue
        if n.op == "get_attr":  # a constant the model made (e.g. a scale as a tensor)
            env[n] = getattr(gm, n.target)
            continue
        if n.op == "output":
            outs = torch.fx.node.map_arg(n.args[0], lambda a: arg(a, n))
            outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
            with fx_traceback.annotate({"pass": "cp" if split_seq else "tp", "why": "output gathered"}):
                if send_seq is not None:
                    return [cp.sent(o, am, send_seq) for o in outs]
                return [o.redistribute(o.device_mesh, [Replicate()] * o.device_mesh.ndim).to_local()
                        if isinstance(o, DTensor) else o for o in outs]
        if n in stacked and isinstance(env[n.args[0]], Unread):
            call, transposed, chain = stacked[n]
            got = read_experts([env[n.args[0]]], n, transposed)
            if got is not None:
                owned[tuple(call.args[1])] = got
                skipped |= chain
                b = expert_blocks[call]
                if b.routing is not None and b.chunks != ep.shard_size:
                    raise AutoparError(f"expert parallelism: {call.name}'s 3-D experts, each rank reading its own, "
                                       f"come after calls of the same block that read every expert's weights")
                b.chunks = ep.shard_size
        if n in skipped:
            continue
        ws = tuple(n.args[1]) if n in expert_blocks and read_experts is not None else ()
        if ws and ws not in owned and all(isinstance(env.get(w), Unread) for w in ws):
            owned[ws] = read_experts([env[w] for w in ws], n)
        if owned.get(ws) is not None:
            args = (arg(n.args[0], n), None, arg(n.args[2], n))
        else:
            args = torch.fx.node.map_arg(n.args, lambda a: arg(a, n))
        kwargs = torch.fx.node.map_arg(n.kwargs, lambda a: arg(a, n))
        with fx_traceback.annotate({**n.meta.get("custom", {}), "pass": "tp" if rules else "step", "source": n.name}):
            out = None
            if n in bias_adds:
                out = _expert_bias(n, bias_adds[n], ep, am, env, lambda a: arg(a, n))
            elif n in expert_blocks:
                mine = owned.get(ws)
                if am is not None and am.has("tp"):
                    picked = _picked_tokens(n) if n in expert_blocks[n].dispatched_inputs else None
                    tokens = (arg(picked[0], picked[2]), env[picked[1]]) if picked is not None else None
                    out = _expert_parallel_tp(n, args, expert_blocks[n], ep, mine, am, tokens)
                else:
                    out = ep_pass.grouped(n, args, expert_blocks[n], ep, mine[0] if mine else None)
            elif split_seq and n.target in ATTENTION_OPS:
                with fx_traceback.annotate({"pass": "cp"}):
                    kv_nodes = (n.args[1], n.args[2]) if len(n.args) > 2 else (None, None)
                    out = cp.attention(n.target, args, kwargs, am, n.meta["val"][0], len(n.meta["val"]), kv_nodes, env)
            elif split_seq and n.target == _aten.nll_loss_forward.default and cp.splits_loss(args, am):
                with fx_traceback.annotate({"pass": "cp"}):
                    out = cp.mean_nll(args, am)
            elif split_seq and n.target == _aten._log_softmax.default:
                out = cp.rowwise(n.target, args, kwargs, am)
            elif rules is not None and args and isinstance(args[0], DTensor):
                if n.target == _aten.embedding.default:
                    out = _vocab_embedding(args, kwargs, am)
                elif n.target == GROUPED_MM:
                    picked = _picked_tokens(n)
                    if picked is not None:
                        tokens, idx, index = picked
                        out = _grouped_linear((arg(tokens, index), *args[1:]), am, pick=env[idx])
                    if out is None:
                        out = _grouped_linear(args, am)
                elif n.target == _aten.mul.Tensor and len(args) == 2:
                    out = _scaled_partial(args, am)
                elif n.target == _aten.index_add.default:
                    out = _added_rows_partial(n, args, am)
                elif n.target in SPLIT_OPS:
                    out = _local_split(args[0], n, args, am)
                elif n.target == _aten.slice.Tensor:
                    out = _local_slice(args[0], n, args, am)
                elif n.target in (_aten.view.default, _aten._unsafe_view.default, _aten.reshape.default):
                    out = _local_view(args[0], n, am)
                    if out is None:
                        out = _unflattened_tokens(args[0], n, am)
                    if out is None:
                        out = _flattened_tokens(args[0], n, am)
            if (out is None and am is not None and n.target == _aten.view.default and args
                    and isinstance(args[0], DTensor) and not args[0].to_local().is_contiguous()):
                # The traced kernel's output strides allowed a view; the replayed local shard
                # (attention DTensor ran on other heads' layout) may not: view a contiguous copy.
                out = n.target(args[0].clone(memory_format=torch.contiguous_format), *args[1:], **kwargs)
            if out is None and am is not None and n.target in SPLIT_OPS and args and not isinstance(args[0], DTensor):
                out = _split_feature_shard(n, args, am)
            if out is None:
                try:
                    out = n.target(*args, **kwargs)
                except NotImplementedError as e:
                    if am is None or "sharding strategy" not in str(e):
                        raise
                    out = _on_whole_values(n.target, args, kwargs, am)
            if rules is not None and isinstance(out, torch.Tensor) and out.is_floating_point():
                if n in rules.to_residual:
                    out = to_tp(out, act)
        env[n] = out
        if watch is not None:
            watch(n, out)
    raise AutoparError("the step graph has no output")


def build_joint(sg, layout: Layout, rules: TPRules | None, sp: bool, example: list,
                stamping: bool = True) -> torch.fx.GraphModule:
    """The joint graph ``(primals, tangents) -> [*outputs, *gradients]`` on local tensors.

    ``primals`` = local parameter shards, buffers, inputs (and target). Gradients are returned
    for the parameters that require them, in parameter order, averaged over data parallelism,
    then for the inputs that require them (a pipeline stage's received activations). There is one
    tangent per output in ``grad_outputs``; the data-parallel average (1/dp) is applied where the
    gradient starts, at the graph that makes the model's output (the last pipeline stage).
    ``stamping``: each run of identical layers replayed once, the others copied (``stamp.py``)."""
    P = sg.n_params
    wrt_index = grad_inputs(sg, example)
    dp = layout.dp_size if sg.final else 1
    outs_meta = output_values(sg)
    float_out = grad_outputs(sg)
    am = layout.act_mesh
    seq = cp.seq_len(sg) if am is not None and am.has("cp") else None
    send_seq = seq if seq is not None and not sg.final else None  # a stage sends its own tokens on

    def out_shape(shape):
        return cp.message_shape(shape, send_seq, am.size("cp")) if send_seq is not None else shape

    def read(i: int, x: torch.Tensor, consumer: torch.fx.Node) -> torch.Tensor:
        """Parameter ``i`` as the step reads it: gathered over data parallelism (recorded where
        its first consumer runs, so the gather sits next to its use) and wrapped for TP."""
        compute = layout.compute if x.is_floating_point() else None
        if layout.dp_mesh is not None and not layout.once:
            fsdp = any(isinstance(p, Shard) for p in layout.dp_placements(i))
            use_layer = consumer.meta.get("custom", {}).get("layer")
            with fx_traceback.annotate({"pass": "fsdp" if fsdp else "ddp", "source": sg.param_names[i],
                                        "param_index": i, "use_layer": use_layer}):
                x = read_param(x, layout.dp_mesh, layout.dp_submeshes, layout.dp_placements(i),
                               layout.tp_local_shape(i), compute, layout.reduce)
        elif compute is not None and x.dtype != compute:
            with fx_traceback.annotate({"pass": "mp", "source": sg.param_names[i], "param_index": i}):
                x = x.to(compute)  # its gradient comes back in the parameter's dtype
        if am is not None:
            # Whole on every cp rank; each rank's gradient is its tokens' partial sum, reduced
            # with the data-parallel gradients (FSDP over dp_shard x cp) instead of apart.
            tp_pl = layout.tp.get(i, Replicate())
            # (``grad_placements`` only where cp needs it: torch before 2.13 has no such argument)
            grad = {"grad_placements": am.placements(tp=tp_pl, cp=Partial())} if am.has("cp") else {}
            with fx_traceback.annotate({"pass": "tp", "source": sg.param_names[i], "param_index": i}):
                x = DTensor.from_local(x, am.mesh, am.placements(tp=tp_pl), run_check=False,
                                       shape=torch.Size(layout.shapes[i]),
                                       stride=torch.empty(layout.shapes[i], device="meta").stride(), **grad)
        return x

    def read_experts(unread: list[Unread], consumer: torch.fx.Node, transposed: bool | None = None) -> list[torch.Tensor]:
        """A grouped linear's expert weights as this rank's experts' whole weights
        (``ep.owned_weights``: their TP shards under TP) and their TP placement, each shard first
        made whole over the replicas (HSDP) and cast to the compute dtype, as ``read_param`` reads
        it; None where the weights are not split alike and evenly over the ep ranks (then each is
        gathered whole). ``transposed`` (not None): ``unread`` is one 3-D parameter of every
        expert (``ep_pass.stacked_weights``); its FSDP shard along the experts is this rank's
        experts' weights, or, over a multiple of the ep ranks, one piece of them, the rest
        gathered over its shard group (``ep_pass.assembled_stacked``); once per step the runtime
        gathers them so (``zero.StepWeights``). Each as it is or transposed."""
        dim = layout.owned_dim([u.index for u in unread])
        if dim is None or (transposed is not None and dim != 0):
            return None
        tp_pl = layout.tp.get(unread[0].index, Replicate())
        xs = []
        use_layer = consumer.meta.get("custom", {}).get("layer")
        with fx_traceback.annotate({"pass": "ep", "why": ep_pass.WEIGHTS, "use_layer": use_layer}):
            if layout.once and transposed is not None:  # this rank's experts, as the runtime gathered them (zero.py)
                return [w.t() if transposed else w for w in unread[0].local.unbind(0)], _expert_placement(tp_pl, transposed)
            if layout.once:  # what the runtime's collectives before the step received (zero.py)
                got = torch.stack([u.local for u in unread], 1)  # (shard ranks' groups, E, *shard)
                n = layout.ep.size * layout.ep.shard_size
                return ep_pass.assembled(got.reshape(got.shape[0] * got.shape[1], *got.shape[2:]), n, dim), tp_pl
            for u in unread:
                x = u.local
                if "dp_replicate" in layout.dp_dims:
                    with fx_traceback.annotate({"pass": "ddp", "source": sg.param_names[u.index],
                                                "param_index": u.index}):
                        x = replicated(x, layout.dp_submeshes[("dp_replicate",)])
                if layout.compute is not None and x.dtype != layout.compute:
                    x = x.to(layout.compute)
                xs.append(x)
            if transposed is not None:
                mine = ep_pass.assembled_stacked(xs[0], layout.ep)
                return [w.t() if transposed else w for w in mine.unbind(0)], _expert_placement(tp_pl, transposed)
            return ep_pass.owned_weights(xs, layout.ep, dim), tp_pl

    def replayed(primals, tangents, gm=sg.gm, rules=rules, watch=None, stamped=frozenset()):
        """``gm``: the step graph replayed (the reduced one, whose copies ``stamp`` adds, with
        the parameters ``stamped`` read by none of its nodes, and ``rules`` on its nodes);
        ``watch``: ``replay``'s."""
        with implicit_replication():
            vals = [Unread(functools.partial(read, i, x), i, x) for i, x in enumerate(primals[:P])]
            rest = list(primals[P:])
            first = P + len(sg.buffer_names)
            if am is not None and am.has("cp") and sg.first:
                # The inputs and the target (everything after the buffers), split along the sequence.
                rest = [cp.split_sequence(x, am, seq) if i >= first else x for i, x in enumerate(rest, start=P)]
            elif am is not None and am.has("cp"):
                # What the stage before sent: each rank's own tokens (``cp.sent``).
                rest = [cp.received(x, am, sg.input_shapes[i - first], seq) if i >= first else x
                        for i, x in enumerate(rest, start=P)]
            elif am is not None:
                # Floating-point inputs (a stage's received activations, images, latents) are whole
                # on every TP rank, as DTensors: what reads them (a patch-embedding convolution's
                # backward) may need both operands distributed.
                inputs = range(first, first + sg.n_inputs)
                rest = [DTensor.from_local(x, am.mesh, am.placements(), run_check=False)
                        if i in inputs and x.is_floating_point() else x for i, x in enumerate(rest, start=P)]
            # Vocabulary-split logits: the cross-entropy (forward and backward) runs on the shards.
            with loss_parallel() if rules is not None and rules.vocab_split else contextlib.nullcontext():
                outs = replay(gm, vals + rest, rules, am, sp, send_seq, layout.ep,
                              read_experts if layout.ep is not None and layout.ep.owners_read else None, watch)
                wrt = [primals[i] for i in wrt_index]
                grads = torch.autograd.grad([outs[i] for i in float_out], wrt, [t / dp for t in tangents],
                                            allow_unused=True)
        missing = [sg.param_names[i] for i, g in zip(wrt_index, grads) if g is None and i < P and i not in stamped]
        if missing:
            raise AutoparError(
                f"{len(missing)} parameter(s) need a gradient but do not get one from the loss: "
                f"{', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}; set requires_grad=False "
                "on parameters the model does not use, or remove them"
            )
        grads = [g if g is not None else torch.zeros_like(w) for g, w in zip(grads, wrt)]
        return [*outs, *grads]

    tangents = [torch.ones(out_shape(outs_meta[i].shape), dtype=outs_meta[i].dtype, device=outs_meta[i].device)
                for i in float_out]

    def joint(primals, tangents):
        return replayed(primals, tangents)

    def trace(fn):
        with fx_traceback.preserve_node_meta(), coords.rank_free():
            return make_fx(fn, tracing_mode="fake", _allow_non_fake_inputs=True)(example, tangents)

    # Runs of identical layers: one replayed, the others stamped from it (``passes/stamp.py``).
    runs = []
    # (not under expert parallelism: each layer's routed rows are sized when it runs, no two alike)
    if stamping and layout.ep is None:
        runs = [r for r in stamp.find_runs(sg.gm, P) if stamp.alike(r, rules, layout)]
    full = None
    if runs and stamp.checking():
        # (traced twice: a process's first trace of some steps makes constants later ones reuse)
        trace(joint)
        full = trace(joint)
    traced = _stamped(trace, replayed, sg, rules, runs, len(outs_meta), wrt_index) if runs else None
    if full is not None and traced is not None:
        stamp.same_graphs(traced, full)
        full.meta.update(traced.meta)
    traced = full or traced or trace(joint)
    # The partitioner takes a functional graph. A write into a tensor nothing else aliases (the
    # model's add_ on a fresh arange, an index_put_ into fresh zeros) is rewritten out of place;
    # what is left (a write through a view) needs functionalisation: a second trace of the whole
    # step, where an Interpreter keeps each node's meta (pass, source, layer) on the new nodes.
    out_of_place(traced)
    drop_transposes_back(traced)
    if not mutates(traced):
        return traced

    def fn(primals, tangents):
        return torch.fx.Interpreter(traced).run(*primals, *tangents)

    with fx_traceback.preserve_node_meta():
        functional = make_fx(torch.func.functionalize(fn, remove="mutations"), tracing_mode="fake",
                             _allow_non_fake_inputs=True)(example, tangents)
    functional.meta.update(traced.meta)
    return functional


def _data_dependent(gm: torch.fx.GraphModule) -> bool:
    """Whether a value of ``gm`` has a size known only when it runs (an unbacked symbol)."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    return any(free_unbacked_symbols(n.meta.get("val")) for n in gm.graph.nodes if "val" in n.meta)


def _stamped(trace, replayed, sg, rules: TPRules | None, runs: list, n_outs: int,
             wrt: list[int]) -> torch.fx.GraphModule | None:
    """The joint graph of the step with only the first two layers of each run replayed, widened
    to every layer (``stamp.expand``); None where the replay does not show what the copies need."""
    rec = stamp.Recorder(runs)
    small = stamp.reduced(sg.gm, runs)
    skipped = frozenset(p for r in runs for k in r.copies for p in r.params[k])
    if rules is not None:  # the same rules, on the reduced graph's nodes
        on = {n.name: n for n in small.graph.nodes}
        rules = dataclasses.replace(
            rules, gathered={on[a.name]: {on[u.name] for u in us if u.name in on}
                             for a, us in rules.gathered.items() if a.name in on},
            to_residual={on[n.name] for n in rules.to_residual if n.name in on})

    def reduced_joint(primals, tangents):
        return replayed(primals, tangents, gm=small, rules=rules, watch=rec, stamped=skipped)

    traced = trace(reduced_joint)
    if _data_dependent(traced):
        # (a copy's values would carry the template's symbols, where each layer's sizes differ)
        log.info("distribute: every layer replayed (sizes known only when the step runs)")
        return None
    names = {k: [n.name for n in r.nodes[k]] for r in runs for k in r.copies}
    try:
        stamp.expand(traced, runs, rec, names, sg.param_names, sg.layers, n_outs, wrt)
    except stamp.NotStampable as e:
        log.info("distribute: every layer replayed (%s)", e)
        return None
    except Exception as e:  # noqa: BLE001 - the replay of every layer is the same graph, made slower
        if stamp.checking():
            raise
        log.warning("distribute: copying layers failed (%s: %s); every layer replayed", type(e).__name__, e)
        return None
    traced.meta["stamped"] = [r.note() for r in runs]
    return traced


def drop_transposes_back(gm: torch.fx.GraphModule) -> None:
    """Read ``x`` where the graph reads ``x`` transposed and transposed back (``t(t(x))``, the
    same two dimensions swapped twice): autograd makes one for every matrix product's input
    gradient (the product's weight, already transposed, transposed again) and for every weight
    gradient. The same view of the same storage, without two nodes per product that every later
    pass, and Inductor, would walk."""
    aten = torch.ops.aten

    def swap(n):
        if n.op != "call_function":
            return None
        if n.target is aten.t.default and isinstance(n.args[0], torch.fx.Node):
            return n.args[0], None
        if n.target is aten.transpose.int and isinstance(n.args[0], torch.fx.Node):
            v = n.args[0].meta.get("val")
            if isinstance(v, torch.Tensor):
                return n.args[0], frozenset(d % max(v.dim(), 1) for d in n.args[1:3])
        return None

    dropped = False
    for n in list(gm.graph.nodes):
        outer = swap(n)
        inner = swap(outer[0]) if outer else None
        if inner is None or outer[1] != inner[1] or not n.users:
            continue
        src, mid = inner[0], outer[0]
        a, b = src.meta.get("val"), n.meta.get("val")
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            continue
        layout = [(tuple(v.shape), v.stride(), v.storage_offset()) for v in (a, b)]
        if not all(isinstance(x, int) for x in pytree.tree_leaves(layout)) or layout[0] != layout[1]:
            continue  # (sized by the data: left as it is)
        n.replace_all_uses_with(src)
        gm.graph.erase_node(n)
        if not mid.users:
            gm.graph.erase_node(mid)
        dropped = True
    if dropped:
        gm.recompile()


def grad_inputs(sg, example: list) -> list[int]:
    """Primal positions that get a gradient: parameters that require one, then the inputs that
    do (a pipeline stage's received activations; not the model's own inputs, images included,
    not buffers, not the target)."""
    P, B = sg.n_params, len(sg.buffer_names)
    params = [i for i in range(P) if example[i].requires_grad]
    inputs = [P + B + j for j in range(sg.n_inputs)
              if example[P + B + j].is_floating_point() and example[P + B + j].requires_grad]
    return params + inputs


def grad_outputs(sg) -> list[int]:
    """Output positions a gradient comes back to: floating point, and not the model's own inputs
    that a pipeline stage passes on to the next (images travel along like token ids)."""
    outs = output_values(sg)
    passed_on = 0 if sg.final else sg.n_inputs - sg.n_received
    return [i for i, v in enumerate(outs) if v.is_floating_point() and i < len(outs) - passed_on]


def output_values(sg) -> list:
    out = next(iter(sg.gm.graph.find_nodes(op="output")))
    args = out.args[0] if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    return [a.meta["val"] for a in args]


def distribute(gm: torch.fx.GraphModule, plan, ctx: passes.PassContext) -> torch.fx.GraphModule:
    """Pass entry: ``gm`` is the single-device step graph; ``ctx.step`` carries its StepGraph,
    the Layout, the TP rules and the example primals."""
    s = ctx.step
    assert s.graph.gm is gm
    joint = build_joint(s.graph, s.layout, s.rules, bool(plan.sp) and plan.tp > 1, s.example,
                        stamping="stamp" not in ctx.disabled)
    for line in joint.meta.get("stamped", ()):
        ctx.note("distribute", line)
    return joint
