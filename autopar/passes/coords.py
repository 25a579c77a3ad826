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

The op is used only where the group's rank equals the coordinate DTensor asked for on that rank,
so a rank running the code another rank compiled (the same text) computes its own values.
Uneven shards (sizes differ per rank, so the graphs do anyway) keep DTensor's own code.

``recording()`` notes every read of this rank's place made while the passes run (a mesh
coordinate, a rank, a submesh's or a group's members) that is not turned into the run-time op,
with the ranks that would read the same value: the graphs are valid as they are on exactly the
ranks every read agrees on (``Reads.ranks``; ``passes/shared.py`` hands them to those ranks).
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor import _redistribute, placement_types
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


def run_time_rank(like: torch.Tensor, mesh, mesh_dim: int, coordinate=None) -> torch.Tensor | None:
    """The coordinate on ``mesh_dim`` (this rank's, or ``coordinate``, which DTensor read for it)
    as ``group_rank``, or None where the group's rank is not it. Its own reads are not noted: the
    graph reads the rank at run time."""
    with _not_noted():
        if coordinate is None:
            coordinate = mesh._sym_get_coordinate(mesh_dim)
        if not isinstance(coordinate, int):
            return None
        pg = mesh.get_group(mesh_dim)
        if pg.rank() != coordinate:
            return None
    return torch.ops.autopar.group_rank(like, pg.group_name)


def coordinate(mesh, mesh_dim: int) -> int:
    """This rank's coordinate on ``mesh_dim``, to be written into the graph (a noted read)."""
    return mesh.get_local_rank(mesh_dim)


def _mask_partition(self, tensor: torch.Tensor, mesh, mesh_dim: int) -> torch.Tensor:
    """``_MaskPartial._partition_value`` (ids outside this rank's rows masked and shifted to its
    shard) with the shard's offset read at run time."""
    n = mesh.size(mesh_dim)
    rows = self.offset_shape[self.offset_dim]
    r = run_time_rank(tensor, mesh, mesh_dim) if rows % n == 0 else None
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
    _discharge(out, mesh, mesh_dim, shard_index)
    return out if out is not None else _ORIGINAL["shard"](self, local_tensor, mesh, mesh_dim, shard_index)


def _replicate_to_strided_shard(self, local_tensor: torch.Tensor, mesh, mesh_dim: int, shard_index) -> torch.Tensor:
    """``_StridedShard._replicate_to_strided_shard``: this rank's chunk of each of the parts."""
    out = _chunk(local_tensor, self.dim, mesh, mesh_dim, shard_index, self._split_factor_int())
    _discharge(out, mesh, mesh_dim, shard_index)
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
        with _not_noted():
            own = mesh.get_local_rank(mesh_dim)
        out = _chunk(all_gather(x, gather_dim, mesh, mesh_dim), shard_dim, mesh, mesh_dim, own)
        if out is not None:
            return out
    return _ORIGINAL["alltoall"](x, gather_dim, shard_dim, mesh, mesh_dim)


def _to_new_shard_dim(self, local_tensor: torch.Tensor, mesh, mesh_dim: int, current_logical_shape,
                      new_shard_dim: int) -> torch.Tensor:
    """``Shard._to_new_shard_dim`` (a shard moved to another dim: an all-to-all). DTensor reads the
    rank's coordinate for the unpadding, which uses it only where the new dim splits unevenly;
    where it splits evenly, the same steps without that read."""
    n = mesh.size(mesh_dim)
    size = current_logical_shape[new_shard_dim]
    if not isinstance(size, int) or size % n or mesh.get_coordinate() is None:
        return _ORIGINAL["new_dim"](self, local_tensor, mesh, mesh_dim, current_logical_shape, new_shard_dim)
    padded = Shard._pad_for_new_shard_dim(current_logical_shape, local_tensor, n, self.dim, new_shard_dim)
    moved = placement_types.shard_dim_alltoall(padded, self.dim, new_shard_dim, mesh, mesh_dim)
    return Shard._unpad_for_new_shard_dim(current_logical_shape, moved, n, self.dim, new_shard_dim, 0)


def _even(shape, splits) -> bool:
    """Whether splitting ``shape`` by ``splits`` ((tensor dim, parts), in order) is even at every
    step: then every rank's local shape is the same, whatever its coordinates."""
    shape = list(shape)
    for dim, parts in splits:
        if not isinstance(shape[dim], int) or shape[dim] % parts:
            return False
        shape[dim] //= parts
    return True


def _noted_if_uneven(shape, splits, original: str, *args):
    """DTensor's ``_ORIGINAL[original]`` on ``args``, its reads of the rank's coordinates noted
    only where splitting ``shape`` by ``splits`` is uneven (only then do ranks' shapes differ)."""
    if not _even(shape, splits):
        return _ORIGINAL[original](*args)
    with _not_noted():
        return _ORIGINAL[original](*args)


def _parts(placement, mesh, mesh_dim: int) -> int:
    return mesh.size(mesh_dim) * (placement._split_factor_int() if isinstance(placement, _StridedShard) else 1)


def _logical_shape(self, src_state, mesh_dim: int, full_tensor_shape) -> list:
    """``DTensorRedistributePlanner.get_logical_shape`` (a value's shape on a mesh dim, sharded
    over the others), which DTensor works out from the rank's coordinates on the other dims:
    where each of them splits evenly, every rank's shape is the same, so that read is not noted."""
    mesh = self.device_mesh
    splits = [(e.tensor_dim, _parts(src_state.placements[d], mesh, d))
              for e in src_state.tensor_dim_to_mesh_dim for d in e.mesh_dims if d != mesh_dim]
    return _noted_if_uneven(full_tensor_shape, splits, "logical", self, src_state, mesh_dim, full_tensor_shape)


def _greedy_transforms(self, src_spec, dst_spec) -> list:
    """``DTensorRedistributePlanner.generate_greedy_transform_infos``, which reads the rank's
    coordinate on each sharded mesh dim but the last for the shape left there: not noted where
    each of those splits is even (every rank's shapes the same)."""
    mesh = self.device_mesh
    splits = [(p.dim, _parts(p, mesh, i)) for i, p in enumerate(src_spec.placements[:-1]) if isinstance(p, Shard)]
    return _noted_if_uneven(src_spec.shape, splits, "greedy", self, src_spec, dst_spec)


_PLANNER = _redistribute.DTensorRedistributePlanner
_ORIGINAL = {"mask": _MaskPartial._partition_value, "shard": Shard._replicate_to_shard,
             "strided": _StridedShard._replicate_to_strided_shard, "alltoall": placement_types.shard_dim_alltoall,
             "new_dim": Shard._to_new_shard_dim, "logical": _PLANNER.get_logical_shape,
             "greedy": _PLANNER.generate_greedy_transform_infos}


@contextlib.contextmanager
def rank_free():
    """While tracing: DTensor's rank-dependent masks and chunks read the rank at run time."""
    _MaskPartial._partition_value = _mask_partition
    Shard._replicate_to_shard = _replicate_to_shard
    _StridedShard._replicate_to_strided_shard = _replicate_to_strided_shard
    placement_types.shard_dim_alltoall = _shard_dim_alltoall
    Shard._to_new_shard_dim = _to_new_shard_dim
    _PLANNER.get_logical_shape = _logical_shape
    _PLANNER.generate_greedy_transform_infos = _greedy_transforms
    try:
        yield
    finally:
        _PLANNER.get_logical_shape = _ORIGINAL["logical"]
        _PLANNER.generate_greedy_transform_infos = _ORIGINAL["greedy"]
        _MaskPartial._partition_value = _ORIGINAL["mask"]
        Shard._replicate_to_shard = _ORIGINAL["shard"]
        _StridedShard._replicate_to_strided_shard = _ORIGINAL["strided"]
        placement_types.shard_dim_alltoall = _ORIGINAL["alltoall"]
        Shard._to_new_shard_dim = _ORIGINAL["new_dim"]


class Reads:
    """The reads of this rank's place noted while recording: each with the set of ranks that
    read the same value there (None: every rank does)."""

    def __init__(self, world: int):
        self.world = world
        self.log: list[tuple[tuple, frozenset | None]] = []  # (what was read, peers)

    def note(self, what: tuple, peers) -> None:
        self.log.append((what, None if peers is None else frozenset(peers)))

    def discharge(self, mesh, mesh_dim: int, value) -> None:
        """The last read, DTensor's ``mesh._sym_get_coordinate(mesh_dim)`` made inline for the
        call that ``_chunk`` answered with the run-time rank, is not written into the graph."""
        if self.log and self.log[-1][0] == ("coordinate", id(mesh), mesh_dim, value):
            self.log.pop()

    def ranks(self) -> frozenset:
        """The ranks on which the graphs traced here are the graphs they would trace."""
        out = frozenset(range(self.world))
        for _, peers in self.log:
            if peers is not None:
                out &= peers
        return out


class _Coordinates(list):
    """A mesh's ``get_coordinate()`` while recording: each coordinate read (by index, by
    iterating, by comparing) is noted as it is read; testing it against None reads none."""

    def __init__(self, values, mesh, reads: Reads, me: int):
        super().__init__(values)
        self._at = (mesh, reads, me)

    def _note(self, dims) -> None:
        mesh, reads, me = self._at
        for d in dims:
            reads.note(("coordinate", id(mesh), d, list.__getitem__(self, d)), _peers(mesh, (d,), me))

    def __getitem__(self, i):
        self._note(range(len(self))[i] if isinstance(i, slice) else [range(len(self))[i]])
        return list.__getitem__(self, i)

    def __iter__(self):
        self._note(range(len(self)))
        return list.__iter__(self)

    def __eq__(self, other):
        self._note(range(len(self)))
        return list.__eq__(self, other)

    __hash__ = None


_READS: Reads | None = None
_DEPTH = [0]  # inside a noted call (its own inner reads are its business) or a read not to note


@contextlib.contextmanager
def _not_noted():
    _DEPTH[0] += 1
    try:
        yield
    finally:
        _DEPTH[0] -= 1


def _discharge(out, mesh, mesh_dim: int, value) -> None:
    if out is not None and _READS is not None:
        _READS.discharge(mesh, mesh_dim, value)


def _instances(mesh) -> torch.Tensor | None:
    """Every instance of ``mesh``'s shape over the world, (instances, *mesh.shape) global ranks
    (torch's layout of a mesh and its slices); None where this torch has no such layout."""
    try:
        return mesh._layout.remap_to_tensor(mesh._rank_map)
    except AttributeError:
        return None


def _peers(mesh, dims: tuple | None, me: int):
    """The ranks that read what this rank reads: its coordinates on ``dims`` of ``mesh`` (None:
    its instance of ``mesh``, the submesh's members); {me} where that is not known (a mesh
    sliced while tracing holds fake ranks). Plain tensors, outside any tracing."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    with unset_fake_temporarily(), disable_proxy_modes_tracing():
        full = _instances(mesh)
        if type(full) is not torch.Tensor:  # none, or a mesh made while tracing (ranks not known)
            return {me}
        pos = (full == me).nonzero()
        if pos.shape[0] == 0:
            return {me}
        pos = pos[0].tolist()
        if dims is None:
            return None if full.shape[0] == 1 else set(full[pos[0]].flatten().tolist())
        sel = [slice(None)] + [pos[1 + i] if i in dims else slice(None) for i in range(full.dim() - 1)]
        return set(full[tuple(sel)].flatten().tolist())


@contextlib.contextmanager
def recording():
    """Note every read of this rank's place while inside (``Reads``): the mesh's coordinate
    methods, its ``mesh`` (a slice's members), the global rank, a process group's rank and
    members. Reads that only decide whether the run-time rank can be used are not noted."""
    import sys

    import torch.distributed as dist
    from torch._C._distributed_c10d import ProcessGroup
    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import _utils as dtensor_utils

    global _READS
    world, me = dist.get_world_size(), dist.get_rank()
    reads = Reads(world)

    def noting(fn, read):
        """``fn`` noting what it read: ``read(out, *args, **kwargs)`` -> (what, peers). torch's
        structured logging, which stamps its records with the rank, reads nothing for a graph."""
        def wrapped(*args, **kwargs):
            if _DEPTH[0]:
                return fn(*args, **kwargs)
            if sys._getframe(1).f_globals.get("__name__", "").startswith("torch._logging"):
                with _not_noted():
                    return fn(*args, **kwargs)
            with _not_noted():
                out = fn(*args, **kwargs)
                reads.note(*read(out, *args, **kwargs))
            return out
        return wrapped

    def index(m, mesh_dim=None):
        return m.mesh_dim_names.index(mesh_dim) if isinstance(mesh_dim, str) else (mesh_dim or 0)

    def sym_coordinate(out, m, i):
        return ("coordinate", id(m), i, out), _peers(m, (i,), me)

    def local_rank(out, m, mesh_dim=None):
        return ("coordinate", id(m), index(m, mesh_dim), out), _peers(m, (index(m, mesh_dim),), me)

    def members(out, m):
        return ("members", id(m)), _peers(m, None, me)

    def rank(out, *args, **kwargs):
        return ("rank", out), {me}

    def group_members(out, *args, **kwargs):
        return ("group members", tuple(out)), set(out)

    def coordinates(fn):
        """``get_coordinate()``: testing it against None (membership) reads nothing; each
        coordinate is noted as it is read (``_Coordinates``)."""
        def wrapped(m):
            out = fn(m)
            return out if out is None or _DEPTH[0] else _Coordinates(out, m, reads, me)
        return wrapped

    def local_shape(fn):
        """DTensor's local shape of a value (and its offset): a read of the coordinates where
        the shape differs between them (uneven shards) or the offset is asked for."""
        def wrapped(global_shape, mesh_shape, lookup, placements, skip_offset=False):
            static = all(isinstance(n, int) for n in global_shape)  # sized by the data: its lookups are noted
            if _DEPTH[0] or not skip_offset or not callable(lookup) or not static:
                return fn(global_shape, mesh_shape, lookup, placements, skip_offset)
            with _not_noted():
                out = fn(global_shape, mesh_shape, lookup, placements, skip_offset)
                mine = [lookup(i) for i in range(len(mesh_shape))]
                sharding = {i for i, p in enumerate(placements) if p.is_shard()}
                same = sum(mesh_shape[i] for i in sharding) <= 4096 and all(
                    fn(global_shape, mesh_shape, lambda j, i=i, c=c: c if j == i else mine[j], placements, True) == out
                    for i in sharding for c in range(mesh_shape[i]))
            if not same:
                for i in sharding:
                    lookup(i)  # noted
            return out
        return wrapped

    def read_by(read):
        return lambda fn: property(noting(fn.fget, read)) if isinstance(fn, property) else noting(fn, read)

    def unread(fn):
        """DTensor's decomposition-based sharding propagation makes one mesh of one rank, rank 0,
        the same on every rank (``DecompShardingStrategy._get_fake_mesh``): building it reads
        its own members, not this rank's place."""
        def wrapped(*args, **kwargs):
            with _not_noted():
                return fn(*args, **kwargs)
        return wrapped

    patches = [(DeviceMesh, "get_coordinate", coordinates), (DeviceMesh, "_sym_get_coordinate", read_by(sym_coordinate)),
               (DeviceMesh, "get_local_rank", read_by(local_rank)), (DeviceMesh, "get_rank", read_by(rank)),
               (DeviceMesh, "mesh", read_by(members)), (ProcessGroup, "rank", read_by(rank)),
               (c10d, "get_rank", read_by(rank)), (dist, "get_rank", read_by(rank)),
               (c10d, "get_process_group_ranks", read_by(group_members)),
               (dist, "get_process_group_ranks", read_by(group_members)),
               (dtensor_utils, "_compute_local_shape_and_global_offset", local_shape)]
    try:
        from torch.distributed.tensor._decompositions import DecompShardingStrategy
    except ImportError:  # a torch without decomposition-based propagation
        pass
    else:
        patches.append((DecompShardingStrategy, "_get_fake_mesh", unread))
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
    for (owner, name, wrap), (_, _, orig) in zip(patches, saved):
        setattr(owner, name, wrap(orig))
    prev, _READS = _READS, reads
    try:
        yield reads
    finally:
        _READS = prev
        for owner, name, orig in reversed(saved):
            setattr(owner, name, orig)
