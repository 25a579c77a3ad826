"""Context parallelism on the traced step: each sequence split over the ``cp`` mesh dim.

The distribute pass replays the single-device graph on DTensors whose mesh holds ``cp`` (and
``tp``): the token inputs and the target enter split along the sequence (``Shard(1)`` on cp, a
local slice: every cp rank of a data-parallel group receives the same sequences), and DTensor's
sharding propagation carries that split through every token-wise op, so positions, rotary tables
and masks made from ``arange`` are sliced to each rank's tokens where they meet the activations.
Two ops are replayed here instead of by DTensor's rules:

- **attention** (the fused ``scaled_dot_product`` ops): the keys and values of the whole sequence
  are all-gathered over cp (their gradients reduce-scattered back), and each rank computes the
  rows of its own queries against them with the causal or given mask cut to those rows. The
  causal work is balanced: the sequence is ``2 cp`` chunks, rank ``r`` owns chunks ``2r`` and
  ``2r + 1``, and swaps its second chunk's queries (and back, their outputs) with rank
  ``cp - 1 - r``, so it computes chunks ``2r`` and ``2 cp - 1 - 2r``: the same number of
  query-key pairs on every rank (torchtitan's head-tail balance, per layer, with the
  activations kept in sequence order). ``r`` and the partner are read when the step runs
  (``coords.group_rank``, ``mirror_swap``), so every cp rank's graph is the same and compiles once.
- the **mean cross-entropy** (``nll_loss_forward`` with mean reduction) over split tokens: the
  sum over each rank's tokens divided by the count of counted tokens of the whole batch, which
  stays the single-process mean when ``ignore_index`` tokens are unevenly spread (DTensor's own
  rule averages the ranks' means).

Parameters are whole on every cp rank (FSDP gathers them over ``dp_shard x cp``); each rank's
gradient is its tokens' partial sum, reduced with the data-parallel gradients in one collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx.traceback as fx_traceback
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.fx.operator_schemas import normalize_function

from autopar.fxops import additive_mask
from autopar.passes import coords

_aten = torch.ops.aten



@dataclass(frozen=True)
class ActMesh:
    """The mesh the replay's DTensors live on: the ``cp`` and ``tp`` dims of size > 1, in mesh order."""

    mesh: object
    names: tuple

    @classmethod
    def of(cls, mesh, dims: tuple) -> ActMesh | None:
        return cls(mesh[dims if len(dims) > 1 else dims[0]], dims) if dims else None

    def has(self, dim: str) -> bool:
        return dim in self.names

    def size(self, dim: str) -> int:
        return self.mesh.size(self.names.index(dim)) if dim in self.names else 1

    def placements(self, tp=None, cp=None) -> tuple:
        """Placements over the mesh: ``tp`` on the tp dim, ``cp`` on the cp dim (Replicate if None)."""
        by = {"tp": tp or Replicate(), "cp": cp or Replicate()}
        return tuple(by[d] for d in self.names)

    def tp_of(self, x: DTensor):
        return x.placements[self.names.index("tp")]

    def with_dim(self, placements, dim: str, p) -> tuple:
        """``placements`` with the entry of mesh dim ``dim`` replaced by ``p``."""
        i = self.names.index(dim)
        return (*placements[:i], p, *placements[i + 1:])

    def with_tp(self, x: DTensor, p) -> tuple:
        return self.with_dim(x.placements, "tp", p)


def split_sequence(x: torch.Tensor, am: ActMesh, seq_len: int) -> torch.Tensor:
    """An input whose dim 1 is the sequence, whole on every rank, as the DTensor of this rank's
    tokens (a local slice); anything else as a replicated DTensor (floating point) or unchanged."""
    whole = DTensor.from_local(x, am.mesh, am.placements(), run_check=False)
    if x.dim() >= 2 and x.shape[1] == seq_len:
        return whole.redistribute(am.mesh, am.placements(cp=Shard(1)))
    return whole if x.is_floating_point() else x


def seq_len(sg) -> int:
    """The whole sequence length of a step or stage graph (its first model input: token ids)."""
    return sg.input_shapes[sg.n_received][1]


def message_shape(shape, seq: int, cp: int) -> tuple:
    """The shape a value has between pipeline stages: one cp rank's part of the sequence when
    dim 1 is the sequence (each rank sends and receives its own tokens' activations)."""
    shape = tuple(shape)
    return (shape[0], shape[1] // cp, *shape[2:]) if len(shape) >= 2 and shape[1] == seq else shape


def received(x: torch.Tensor, am: ActMesh, shape: tuple, seq: int) -> torch.Tensor:
    """A value the stage before sent (``message_shape``; ``shape``: its whole shape) as the
    DTensor it stands for: this rank's part of the sequence, or whole."""
    if len(shape) >= 2 and shape[1] == seq:
        return DTensor.from_local(x, am.mesh, am.placements(cp=Shard(1)), run_check=False, shape=torch.Size(shape),
                                  stride=torch.empty(shape, device="meta").stride())
    return DTensor.from_local(x, am.mesh, am.placements(), run_check=False) if x.is_floating_point() else x


def sent(o, am: ActMesh, seq: int):
    """A stage's output as it goes to the next stage (``message_shape``): this rank's part of
    the sequence, whole on tp; anything else whole."""
    if isinstance(o, torch.Tensor) and o.dim() >= 2 and o.shape[1] == seq:
        if not isinstance(o, DTensor):
            o = DTensor.from_local(o, am.mesh, am.placements(), run_check=False)
        return o.redistribute(am.mesh, am.placements(cp=Shard(1))).to_local()
    return o.redistribute(o.device_mesh, [Replicate()] * o.device_mesh.ndim).to_local() if isinstance(o, DTensor) else o


@torch.library.custom_op("autopar::mirror_swap", mutates_args=())
def mirror_swap(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """``x`` exchanged with the rank at the mirror place of process group ``group_name`` (rank
    ``r`` with ``n - 1 - r``; the middle rank of an odd group keeps its own), along dim 0: one
    all-to-all whose only nonempty split is the partner's. The partner is read when it runs, so
    every rank's graph holds the same call (the group name is last, as a collective's, for
    ``passes/groups.py``). It returns when the exchange is done (no wait to schedule)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    pg = _resolve_process_group(group_name)
    n, r = pg.size(), pg.rank()
    partner = n - 1 - r
    if partner == r:
        return x.clone()
    x = x.contiguous()
    out = torch.empty_like(x)
    splits = [x.shape[0] if j == partner else 0 for j in range(n)]
    dist.all_to_all_single(out, x, splits, splits, group=pg)
    return out


@mirror_swap.register_fake
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _mirror_swap_backward(ctx, grad):
    return mirror_swap(grad, ctx.group_name), None  # the exchange is its own inverse


def _mirror_swap_setup(ctx, inputs, output):
    ctx.group_name = inputs[1]


mirror_swap.register_autograd(_mirror_swap_backward, setup_context=_mirror_swap_setup)


def _swap(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """``x`` (batch, heads, rows, dim) exchanged with the mirror rank of the group (``mirror_swap``
    along the rows), differentiably: the backward swaps the gradients back."""
    return mirror_swap(x.transpose(0, 2).contiguous(), group_name).transpose(0, 2)


def _local_mask(mask, q: DTensor, am: ActMesh) -> torch.Tensor | None:
    """An attention mask as this rank's local tensor over the whole key sequence: replicated on
    cp; on tp, split with the query heads when it has a heads dim of its own."""
    if mask is None:
        return None
    heads = mask.dim() == 4 and mask.shape[1] > 1
    tp_pl = am.tp_of(q) if am.has("tp") and heads else Replicate()
    if isinstance(mask, DTensor):
        return mask.redistribute(am.mesh, am.placements(tp=tp_pl)).to_local()
    if isinstance(tp_pl, Shard):
        tp = am.size("tp")
        return mask.chunk(tp, tp_pl.dim)[am.mesh.get_local_rank(am.names.index("tp"))]
    return mask


# What the AC pass recomputes in the backward instead of keeping (the whole sequence's keys and values).
KV_GATHERED = "cp keys and values gathered"
_REPEAT_CHAIN = {_aten.slice.Tensor, _aten.unsqueeze.default, _aten.expand.default, _aten.clone.default,
                 _aten.view.default, _aten._unsafe_view.default, _aten.reshape.default, _aten.alias.default}


def unrepeated(node: torch.fx.Node, env: dict):
    """The key or value heads before grouped-query attention repeated them (HF's ``repeat_kv``:
    ``x[:, :, None].expand(b, kv, n, s, d).reshape(b, kv * n, s, d)``) as (value, n), or
    (``node``'s value, 1) when ``node`` is not such a repeat: context parallelism then gathers
    ``kv`` heads, not ``kv * n``."""
    chain, x = [], node
    while isinstance(x, torch.fx.Node) and x.op == "call_function" and x.target in _REPEAT_CHAIN:
        chain.append(x)
        x = x.args[0]
    expands = [n for n in chain if n.target == _aten.expand.default]
    if not isinstance(x, torch.fx.Node) or len(expands) != 1 or not isinstance(env.get(x), DTensor):
        return env[node], 1
    base, out = x.meta["val"], node.meta["val"]
    src, dst = expands[0].args[0].meta["val"].shape, expands[0].meta["val"].shape
    n = dst[2] if len(dst) == 5 else 0
    if not all(_whole_slice(s) for s in chain if s.target == _aten.slice.Tensor):
        return env[node], 1
    if (base.dim() != 4 or out.dim() != 4 or len(src) != 5 or src[2] != 1 or n < 2
            or tuple(src[:2]) + tuple(src[3:]) != tuple(base.shape) or tuple(out.shape) != (
                base.shape[0], base.shape[1] * n, *base.shape[2:])):
        return env[node], 1
    return env[x], n


def _whole_slice(s: torch.fx.Node) -> bool:
    """A ``slice`` that keeps every element (HF's ``x[:, :, None, :, :]`` traces to such slices)."""
    dim, start, end, step = (list(s.args[1:]) + [0, None, None, 1][len(s.args) - 1:])[:4]
    size = s.args[0].meta["val"].shape[dim]
    return start in (0, None) and (end is None or end >= size) and step == 1


def attention(target, args: tuple, kwargs: dict, am: ActMesh, like: torch.Tensor, n_out: int, kv_nodes=(None, None),
              env=None):
    """A fused attention op on queries split along the sequence over cp (see the module
    docstring), as a tuple like the op's with only the output filled; None when the queries are
    not split that way (DTensor's own rules then run it). ``like``: the traced op's output;
    ``kv_nodes``: the graph nodes of its keys and values (gathered before a GQA repeat)."""
    a = normalize_function(target, args, kwargs, normalize_to_only_use_kwargs=True).kwargs
    q, k, v = a["query"], a["key"], a["value"]
    ci = am.names.index("cp")
    if not isinstance(q, DTensor) or q.placements[ci] != Shard(2) or q.dim() != 4:
        return None
    (k, n_k), (v, n_v) = ((unrepeated(node, env) if isinstance(node, torch.fx.Node) and env is not None else (t, 1))
                          for node, t in zip(kv_nodes, (k, v)))
    # Contiguous first: a DTensor's global strides must describe its local tensor (a reshape in
    # the backward decides by them), and the gradients that come back here are made contiguous.
    q, k, v = (t.contiguous() if isinstance(t, DTensor) else t for t in (q, k, v))
    cp = am.size("cp")
    S = q.shape[2]
    c = S // (2 * cp)
    # Keys and values of the whole sequence; each rank's gradient for them is a partial sum
    # over its queries, reduce-scattered back to the ranks that own those tokens.
    kv = []
    for t, n in ((k, n_k), (v, n_v)):
        if not isinstance(t, DTensor):
            t = DTensor.from_local(t, am.mesh, am.placements(), run_check=False)
        with fx_traceback.annotate({"why": KV_GATHERED}):
            whole = t.redistribute(am.mesh, am.with_dim(t.placements, "cp", Replicate()))
            local = _ContiguousGrad.apply(whole.to_local(grad_placements=am.with_dim(whole.placements, "cp", Partial())))
            kv.append(local.repeat_interleave(n, dim=1) if n > 1 else local)
    kl, vl = kv
    group = am.mesh.get_group(ci).group_name
    ql = _ContiguousGrad.apply(q.to_local())
    qb = torch.cat([ql.narrow(2, 0, c), _swap(ql.narrow(2, c, c), group)], 2)
    # The query rows this rank computes: chunk 2r and the mirror rank's second, 2cp - 1 - 2r,
    # r (the rank in the cp group, its mesh coordinate there) read when the step runs, as the
    # swap reads its partner: every cp rank's graph the same.
    r = coords.group_rank(ql, group)
    step = torch.arange(c, device=ql.device)
    rows = torch.cat([step + 2 * c * r, step + (2 * cp - 1) * c - 2 * c * r])
    mask = _local_mask(a.get("attn_mask", a.get("attn_bias")), q, am)
    if mask is not None:
        if mask.dim() >= 2 and mask.shape[-2] == S:
            mask = mask.index_select(-2, rows)
    elif a.get("is_causal"):
        mask = torch.arange(S, device=ql.device)[None, :] <= rows[:, None]
    scale, dropout = a.get("scale"), a.get("dropout_p", 0.0)
    if target == _aten._scaled_dot_product_flash_attention_for_cpu.default:
        if mask is not None and mask.dtype == torch.bool:
            mask = additive_mask(mask, ql.dtype)
        out = target(qb, kl, vl, dropout, False, attn_mask=mask, scale=scale)[0]
    else:
        out = F.scaled_dot_product_attention(qb, kl, vl, attn_mask=mask, dropout_p=dropout, scale=scale,
                                             enable_gqa=kl.shape[1] != qb.shape[1])
    out = _laid_out_as(torch.cat([out.narrow(2, 0, c), _swap(out.narrow(2, c, c), group)], 2), like)
    return (DTensor.from_local(out, am.mesh, q.placements, run_check=False, shape=like.shape, stride=like.stride()),
            *([None] * (n_out - 1)))


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose gradient is made contiguous: an attention kernel's input gradients may come
    in another memory order, and the DTensor they go back into describes a contiguous one."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g.contiguous()


def _laid_out_as(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` in the memory order of ``like`` (the traced op's output, e.g. CPU flash attention's
    (batch, seq, heads, dim) layout under a (batch, heads, seq, dim) shape), which the views
    traced after it rely on."""
    order = sorted(range(like.dim()), key=lambda d: -like.stride(d))
    return t.permute(order).contiguous().permute([order.index(d) for d in range(like.dim())])


def _as_rows(x, am: ActMesh):
    """``x`` (batch and sequence flattened into dim 0: ``_StridedShard`` on cp) relabelled as
    ``Shard(0)``: the same local rows, in another global order. Sound only for what treats rows
    alike: a row-wise op (relabelled back after) or a reduction over all rows with its targets
    relabelled the same way. Loss parallelism (the vocabulary split over tp) takes no other."""
    if not isinstance(x, DTensor):
        return x
    i = am.names.index("cp")
    p = x.placements[i]
    if not isinstance(p, _StridedShard) or p.dim != 0:
        return x
    return DTensor.from_local(x.to_local(), am.mesh, am.with_dim(x.placements, "cp", Shard(0)), run_check=False,
                              shape=x.shape, stride=x.stride())


def rowwise(target, args: tuple, kwargs: dict, am: ActMesh):
    """``_log_softmax`` over the last dim of flattened tokens split on cp, run on ``_as_rows``
    (loss parallelism refuses a ``_StridedShard``); None when the input is not that."""
    x = args[0]
    rows = _as_rows(x, am)
    if rows is x or x.dim() != 2 or args[1] % 2 != 1:
        return None
    out = target(rows, *args[1:], **kwargs)
    return DTensor.from_local(out.to_local(), am.mesh, x.placements, run_check=False, shape=out.shape,
                              stride=out.stride())


def mean_nll(args: tuple, am: ActMesh):
    """``nll_loss_forward(input, target, weight, mean, ignore_index)`` over tokens split on cp:
    the sum of the losses over the count of counted tokens, each over the whole batch."""
    logp, target, weight, _, ignore = args
    ci = am.names.index("cp")
    if isinstance(target, DTensor) and isinstance(logp, DTensor) and target.placements[ci] == logp.placements[ci]:
        logp, target = _as_rows(logp, am), _as_rows(target, am)  # the same rows relabelled alike
    total, _ = _aten.nll_loss_forward.default(logp, target, weight, 2, ignore)
    counted = target != ignore
    if weight is None:
        count = counted.sum()
    else:
        count = (weight[target.clamp(min=0)] * counted).sum()
    count = count.to(total.dtype)
    return total / count, count


def splits_loss(args: tuple, am: ActMesh) -> bool:
    """Whether an ``nll_loss_forward`` call takes the mean over tokens split on cp."""
    logp = args[0]
    if len(args) < 5 or args[3] != 1 or not isinstance(logp, DTensor):
        return False
    return not logp.placements[am.names.index("cp")].is_replicate()
