"""Data parallelism as parameter placements, SimpleFSDP-style: FSDP (ZeRO-3), HSDP and DDP.

Each parameter (already split by TP) is kept as a shard on the ``dp_shard`` mesh dim, split along
its first dimension that TP does not split (so the two splits are independent and a checkpoint is
an ordinary DTensor), and replicated on ``dp_replicate``; DDP keeps it whole. The step reads it
through ``read_param``: a DTensor on the data-parallel mesh redistributed to replicated (an
all-gather over ``dp_shard``) whose local value carries ``Partial`` gradient placements, so
autograd's backward of that read is the gradient's reduce-scatter (FSDP), all-reduce
(``dp_replicate``, DDP) or both (HSDP), in the graph, with nothing outside it.
"""

from __future__ import annotations

import torch
import torch.fx.traceback as fx_traceback
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard


def dp_placements(shapes: list, tp_placements: dict, dp_shard: int, fsdp: bool) -> dict:
    """parameter index -> Placement on the dp_shard mesh dim."""
    out = {}
    for i, shape in enumerate(shapes):
        pl = Replicate()
        if fsdp and dp_shard > 1:
            tp_dim = getattr(tp_placements.get(i), "dim", None)
            # A leading dim of size 1 (a gate Linear(h, 1)'s weight) is kept whole: split on a
            # later dim, its gather ends in a view that a bucketed gather's strided slice breaks.
            dims = [d for d in range(len(shape)) if d != tp_dim and shape[d] >= dp_shard and shape[0] > 1]
            even = [d for d in dims if shape[d] % dp_shard == 0]
            if even or dims:
                pl = Shard((even or dims)[0])
        out[i] = pl
    return out


def read_param(local: torch.Tensor, dp_mesh, submeshes: dict, dp_pls: list, tp_local_shape: tuple,
               compute: torch.dtype | None = None, reduce: torch.dtype | None = None) -> torch.Tensor:
    """The parameter gathered over the data-parallel mesh (its TP shard), differentiable: the
    gradient is reduced back to this rank's shard. Mixed precision (``compute``/``reduce``, as
    FSDP2's ``param_dtype``/``reduce_dtype``): the shard is cast before its gather, so the gather
    moves compute-dtype bytes; the gradient is cast to ``reduce`` before its reduction and lands in
    the shard's own dtype (under HSDP the replicas' all-reduce of the shard runs in that dtype, the
    reduce dtype of every precision in ``plan.PRECISIONS``). ``submeshes``: ``sub_meshes(dp_mesh)``,
    sliced before tracing (slicing a mesh inside the trace records its index arithmetic, which
    torch 2.11 then refuses as data-dependent)."""
    names = dp_mesh.mesh_dim_names
    replicas = [n for n, p in zip(names, dp_pls) if not isinstance(p, Shard)]
    if replicas and len(replicas) < len(names):
        # HSDP: the shard is read on the replica dims first, so that autograd, which reduces in
        # the reverse order, reduce-scatters the gradient over dp_shard and then all-reduces only
        # the shard over dp_replicate (FSDP2's order: 1/dp_shard of the bytes on the replicas).
        with fx_traceback.annotate({"pass": "ddp"}):
            local = replicated(local, submeshes[tuple(replicas)])
        kept = [(n, p) for n, p in zip(names, dp_pls) if isinstance(p, Shard)]
        dp_mesh, dp_pls = submeshes[tuple(n for n, _ in kept)], [p for _, p in kept]
    stride = torch.empty(tp_local_shape, device="meta").stride()
    d = DTensor.from_local(local, dp_mesh, dp_pls, run_check=False, shape=torch.Size(tp_local_shape), stride=stride)
    whole = [Replicate()] * len(dp_pls)
    mixed = compute is not None and compute != local.dtype
    if list(dp_pls) != whole or mixed:
        d = d.redistribute(dp_mesh, whole, forward_dtype=compute if mixed else None,
                           backward_dtype=reduce if mixed else None)
    return d.to_local(grad_placements=[Partial("sum")] * len(dp_pls))


def sub_meshes(dp_mesh) -> dict:
    """Each proper subset of ``dp_mesh``'s dims (by name tuple) -> that submesh."""
    import itertools

    names = tuple(dp_mesh.mesh_dim_names)
    return {sub: dp_mesh[sub] for k in range(1, len(names)) for sub in itertools.combinations(names, k)}


def replicated(local: torch.Tensor, mesh) -> torch.Tensor:
    """``local`` unchanged; its gradient all-reduced over ``mesh``."""
    n = mesh.ndim
    return DTensor.from_local(local, mesh, [Replicate()] * n, run_check=False).to_local(
        grad_placements=[Partial("sum")] * n)
