"""Tensor and sequence parallelism on the traced step: which parameter is split how, and where
activations change placement. Decided from the data-flow roles of ``roles.step_roles``
(no module names or types):

- a *column* linear's weight (every expert's, for routed experts' grouped linear) is split
  along its output features (``Shard``; a fused projection split into ``k`` equal parts later
  gets ``_StridedShard(split_factor=k)`` so each rank holds
  its own heads of every part), its bias likewise; a *row* linear's weight along its input
  features, its bias replicated; the *head* along the vocabulary, and so is the token embedding
  table (``Shard(0)``; one placement serves both when they are tied);
- the residual stream is replicated, or split along the sequence (dim 1) under SP: it is
  redistributed there at its sources (embedding lookups) and at each row linear's output
  (an all-reduce, or a reduce-scatter under SP); each group of column linears reading the same
  residual node gathers it once (nothing, or an all-gather under SP); the head's logits stay
  split along the vocabulary, and the cross-entropy runs on them there (DTensor's loss
  parallelism: all-reduces of the row max, the sum of exponentials and the target's logit,
  never the logits themselves); anything else that reads them gets them whole.

Every other activation's placement follows by DTensor's sharding propagation through the ops.
A weight whose split size does not divide by the TP degree stays replicated, with the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from autopar.roles import Roles


@dataclass
class TPRules:
    placements: dict  # parameter index -> Placement on the tp mesh dim
    gathered: dict  # residual node -> nodes that read it gathered (column inputs)
    to_residual: set  # nodes whose output becomes the residual placement (rows, embeddings)
    notes: list = field(default_factory=list)
    vocab_split: bool = False  # the head's logits are split along their last dim (the loss runs on the shards)


def placement_str(p) -> str:
    if isinstance(p, _StridedShard):
        return f"S({p.dim},x{p.split_factor})"
    if isinstance(p, Shard):
        return f"S({p.dim})"
    return "R"


def tp_rules(sg, roles: Roles, tp: int, sp: bool, split_head: bool) -> TPRules:
    shapes = [ph.meta["val"].shape for ph in sg.placeholders()[: sg.n_params]]
    names = sg.param_names
    want: dict[int, list] = {}
    notes: list[str] = []

    def ask(i: int, pl) -> None:
        want.setdefault(i, []).append(pl)

    def split(i: int, dim: int, parts: int = 1):
        size = shapes[i][dim]
        if size % (tp * parts):
            notes.append(f"{names[i]}: dim {dim} ({size}) does not split into {parts} x tp={tp}: replicated")
            return Replicate()
        return _StridedShard(dim, split_factor=parts) if parts > 1 else Shard(dim)

    for lin in roles.linears:
        if lin.role == "head" and not split_head:
            notes.append(f"{names[lin.weight]}: replicated, the loss does not read its output through a "
                         "cross-entropy (loss parallelism needs one)")
            ask(lin.weight, Replicate())
            if lin.bias is not None:
                ask(lin.bias, Replicate())
        elif lin.role in ("column", "head"):
            for w in lin.weights:
                ask(w, split(w, lin.out_dim, lin.parts))
            if lin.bias is not None:
                ask(lin.bias, split(lin.bias, 0, lin.parts))
        elif lin.role == "row":
            for w in lin.weights:
                ask(w, split(w, lin.in_dim))
            if lin.bias is not None:
                ask(lin.bias, Replicate())
        elif lin.reason:
            also = f" (and its {len(lin.weights) - 1} other experts')" if lin.group else ""
            notes.append(f"{names[lin.weight]}{also}: replicated, {lin.reason}")
    for i in roles.token_tables:
        ask(i, split(i, 0))
    placements = {}
    for i, pls in want.items():
        if len(set(map(placement_str, pls))) == 1:
            placements[i] = pls[0]
        else:
            notes.append(f"{names[i]}: used with placements {sorted(set(map(placement_str, pls)))}: replicated")
            placements[i] = Replicate()
    sharded = {i for i, p in placements.items() if not isinstance(p, Replicate)}
    gathered = roles.gathered()
    to_residual = set()
    for lin in roles.linears:
        if lin.role == "row" and lin.weight in sharded:
            to_residual.add(roles.reduce_at[lin.node])
    for n in roles.residual:
        if n.op == "placeholder" or (n.op == "call_function" and n.target == torch.ops.aten.embedding.default):
            to_residual.add(n)
    vocab_split = any(lin.role == "head" and lin.weight in sharded for lin in roles.linears)
    return TPRules(placements, gathered, to_residual, notes, vocab_split)
