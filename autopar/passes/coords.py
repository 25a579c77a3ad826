"""A rank's place in its groups, read at run time instead of written into the graph.

Tracing on rank r, DTensor turns the rank's coordinate on a mesh dim into constants of the
graph: the cross-entropy over vocabulary-split logits masks the targets outside
``[r * V/tp, (r + 1) * V/tp)`` and subtracts ``r * V/tp`` (so would a vocabulary-split embedding,
which ``distribute`` runs on the rank's own rows with the offset from ``run_time_rank``); a whole
value that becomes a shard (a bias added to split logits) is cut to chunk ``r``. The TP ranks'
graphs then differ in those numbers only, and each rank compiles its own. Inside ``rank_free()`` both read the coordinate
from ``autopar::group_rank`` (the rank in the mesh dim's process group, a 0-d tensor made at run
time) instead, so the graphs of all ranks of a group are the same text and compile once
(``backend.compile_step``).

Correct by construction: each rank still traces its own graph, and the op is used only where
the group's rank equals the coordinate DTensor asked for on that rank, so a rank running the
code another rank compiled (the same text) computes its own values. Uneven shards (sizes differ
per rank, so the graphs do anyway) keep DTensor's own code.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor import placement_types
from torch.distributed.tensor.placement_types import Shard, _MaskPartial, _StridedShard

_DEVICE_COORDS: dict = {}  # (rank, device) -> that rank as a 0-d int64 tensor on that device


@torch.library.custom_op("autopar::group_rank", mutates_args=())
def group_rank(like: torch.Tensor, group_name: str) -> torch.Tensor:
    """This process's rank in the process group ``group_name``, a 0-d int64 tensor on ``like``'s
    device. ``like`` only places it (and keeps it a step input's dependant: never folded into a
    constant by the compiler); the group name is last, as a collective's, so ``passes/groups.py``
    renames it with theirs."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    rank = _resolve_process_group(group_name).rank()
    key = (rank, like.device)
    if key not in _DEVICE_COORDS:  # made once per device: a host-to-device copy every step would sync
        _DEVICE_COORDS[key] = torch.tensor(rank, dtype=torch.int64, device=like.device)
    return _DEVICE_COORDS[key].clone()  # a fresh buffer: the compiled step may write into its outputs


@group_rank.register_fake
def _(like: torch.Tensor, group_name: str) -> torch.Tensor:
    return like.new_empty((), dtype=torch.int64)


def run_time_rank(like: torch.Tensor, mesh, mesh_dim: int, coordinate) -> torch.Tensor | None:
    """The coordinate on ``mesh_dim`` as ``group_rank``, or None where the group's rank is not it."""
    if not isinstance(coordinate, int):
        return None
    pg = mesh.get_group(mesh_dim)
    if pg.rank() != coordinate:
        return None
    return torch.ops.autopar.group_rank(like, pg.group_name)


def _mask_partition(self, tensor: torch.Tensor, mesh, mesh_dim: int) -> torch.Tensor:
    """``_MaskPartial._partition_value`` (ids outside this rank's rows masked and shifted to its
    shard) with the shard's offset read at run time."""
    n = mesh.size(mesh_dim)
    rows = self.offset_shape[self.offset_dim]
    r = run_time_rank(tensor, mesh, mesh_dim, mesh._sym_get_coordinate(mesh_dim)) if rows % n == 0 else None
    if r is None:
        return _ORIGINAL["mask"](self, tensor, mesh, mesh_dim)
    local, mask = own_rows(tensor, r * (rows // n), rows // n)
    self.mask_buffer.materialize_mask(mask)
    return local


def own_rows(ids: torch.Tensor, start, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids into a table's rows ``[start, start + rows)`` (``start`` a number or a run-time
    tensor) as indices into those rows, with the ids outside them (mask True) read as row 0."""
    local = ids - start
    outside = (local < 0) | (local >= rows)
    return local.masked_fill(outside, 0), outside


def _chunk(x: torch.Tensor, dim: int, mesh, mesh_dim: int, coordinate, pieces: int = 1) -> torch.Tensor | None:
    """Chunk ``coordinate`` of ``x`` split evenly over ``mesh_dim`` on ``dim`` (of each of
    ``pieces`` equal parts, concatenated: a ``_StridedShard``), chosen at run time: ``x`` viewed as
    (pieces, chunks, chunk) on the dim, the rank's chunk kept. None where not even."""
    n = mesh.size(mesh_dim)
    if x.dim() == 0 or x.shape[dim % x.dim()] % (n * pieces):
        return None
    r = run_time_rank(x, mesh, mesh_dim, coordinate)
    if r is None:
        return None
    d = dim % x.dim()
    size = x.shape[d]
    # Kept by a mask and summed over the chunks (one of them nonzero: exact), not by an
    # index_select with the rank as index: Inductor miscompiled that on BART's embedding gradient
    # (wrong values where eager was exact). It reads the whole value once, as its producer wrote it.
    parts = x.unflatten(d, (pieces, n, size // (n * pieces)))
    keep = (torch.arange(n, device=x.device) == r).view([n] + [1] * (parts.dim() - d - 2))
    kept = torch.where(keep, parts, parts.new_zeros(()))
    out = kept.any(d + 1) if x.dtype == torch.bool else kept.sum(d + 1, dtype=x.dtype)
    return out.flatten(d, d + 1)


def _replicate_to_shard(self, local_tensor: torch.Tensor, mesh, mesh_dim: int, shard_index) -> torch.Tensor:
    """``Shard._replicate_to_shard``: this rank's chunk of a whole value."""
    out = _chunk(local_tensor, self.dim, mesh, mesh_dim, shard_index)
    return out if out is not None else _ORIGINAL["shard"](self, local_tensor, mesh, mesh_dim, shard_index)


def _replicate_to_strided_shard(self, local_tensor: torch.Tensor, mesh, mesh_dim: int, shard_index) -> torch.Tensor:
    """``_StridedShard._replicate_to_strided_shard``: this rank's chunk of each of the parts."""
    out = _chunk(local_tensor, self.dim, mesh, mesh_dim, shard_index, self._split_factor_int())
    return out if out is not None else _ORIGINAL["strided"](self, local_tensor, mesh, mesh_dim, shard_index)


def all_gather(x: torch.Tensor, dim: int, mesh, mesh_dim: int) -> torch.Tensor:
    """``x`` of every rank of ``mesh_dim`` concatenated along ``dim``, waited for."""
    from torch.distributed import _functional_collectives as funcol

    whole = funcol.all_gather_single(x.contiguous(), dim, (mesh, mesh_dim))
    return whole.wait() if isinstance(whole, funcol.AsyncCollectiveTensor) else whole


def _shard_dim_alltoall(x: torch.Tensor, gather_dim: int, shard_dim: int, mesh, mesh_dim: int) -> torch.Tensor:
    """``shard_dim_alltoall`` where the process group has no all-to-all (gloo: DTensor gathers,
    then keeps this rank's chunk), the chunk chosen at run time."""
    if mesh.device_type == "cpu":
        out = _chunk(all_gather(x, gather_dim, mesh, mesh_dim), shard_dim, mesh, mesh_dim, mesh.get_local_rank(mesh_dim))
        if out is not None:
            return out
    return _ORIGINAL["alltoall"](x, gather_dim, shard_dim, mesh, mesh_dim)


_ORIGINAL = {"mask": _MaskPartial._partition_value, "shard": Shard._replicate_to_shard,
             "strided": _StridedShard._replicate_to_strided_shard, "alltoall": placement_types.shard_dim_alltoall}


@contextlib.contextmanager
def rank_free():
    """While tracing: DTensor's rank-dependent masks and chunks read the rank at run time."""
    _MaskPartial._partition_value = _mask_partition
    Shard._replicate_to_shard = _replicate_to_shard
    _StridedShard._replicate_to_strided_shard = _replicate_to_strided_shard
    placement_types.shard_dim_alltoall = _shard_dim_alltoall
    try:
        yield
    finally:
        _MaskPartial._partition_value = _ORIGINAL["mask"]
        Shard._replicate_to_shard = _ORIGINAL["shard"]
        _StridedShard._replicate_to_strided_shard = _ORIGINAL["strided"]
        placement_types.shard_dim_alltoall = _ORIGINAL["alltoall"]
