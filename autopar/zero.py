"""FSDP once per step (ZeRO-1, Megatron-LM's distributed optimizer), as autopar's runtime runs it.

Under ``Plan.fsdp_once == "gather"`` the parameters stay sharded between steps (what the optimizer
updates, what a checkpoint holds), but the step graphs read them whole (each rank's TP shard, in
the compute dtype) and add their gradients, unreduced, into buffers the runtime hands them
(``distribute.Layout.once``, ``passes/accumulate.py``). Around the step's microbatches the
runtime then:

1. gathers every parameter once, before the first microbatch (all gathers issued, then waited);
2. runs the microbatches (or the pipeline schedule) on those whole parameters, each backward
   adding its gradients into one whole buffer per parameter in the reduce dtype;
3. after the last one, reduces each buffer once to the parameter's shard (reduce-scatter over
   ``dp_shard``, all-reduce over ``dp_replicate``: the same reduction FSDP runs per microbatch)
   into ``param.grad``, in the parameter's dtype, and frees the whole parameters and buffers.

So per step one gather and one reduction of the parameters, against one per microbatch under
FSDP, for the memory of the whole parameters and gradients of this rank's layers (priced so by
the cost model: ``StageModel`` with ``fsdp_once``). The gathers and reductions run eagerly,
exposed, one collective per layer's parameters (``Once.buckets``), as FSDP buckets them.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard


@dataclass(frozen=True)
class Once:
    """How a plan's step reads its parameters once per step: mixed precision's dtypes (None: the
    parameter's own); the buckets, lists of parameter names (a layer's, the parameters before
    and after the layers), each gathered in one collective and reduced in one, as FSDP buckets
    them per layer in the graph (``passes/overlap.py``) and the cost model prices them; and, under
    expert parallelism where each ep rank owns its experts' weights, each grouped linear's expert
    weights (names, the dim FSDP splits them along), sent to their owners in one all-to-all over
    the ep group (``ep_group``) and their gradients back in one; where FSDP spreads them over a
    multiple of the ep ranks, the owners' pieces then gathered over ``ep_shard_group`` (and the
    gradients reduced over it first). ``stacked``: 3-D expert parameters (experts along dim 0) whose
    shard is this rank's experts' weights, or a piece of them gathered over ``ep_shard_group``
    (``ep.assembled_stacked``): no exchange over the ep group."""

    compute: torch.dtype | None
    reduce: torch.dtype | None
    buckets: tuple
    experts: tuple = ()
    ep_group: str = ""
    ep_shard_group: str = ""
    stacked: tuple = ()


def plan_once(layout, graphs: list) -> Once | None:
    """``Once`` for a layout gathered once per step (None otherwise); ``graphs``: this rank's
    step graphs (a pipeline rank's stages), whose consecutive parameters of one repeated layer
    (or of none) make one bucket; a parameter two stages share is in the first one's."""
    from autopar import analysis

    if not layout.once:
        return None
    experts = {tuple(sg.param_names[i] for i in idx): dim for sg in graphs for idx, dim in layout.owned_experts(sg)}
    stacked = tuple(dict.fromkeys(sg.param_names[i] for sg in graphs for i in layout.owned_stacked(sg)))
    owned = {n for names in experts for n in names} | set(stacked)
    out: list[list[str]] = []
    seen: set = set(owned)
    for sg in graphs:
        last = object()
        for name in sg.param_names:
            if name in seen:
                continue
            seen.add(name)
            layer = analysis.layer_index(name, sg.layers)
            if out and layer == last:
                out[-1].append(name)
            else:
                out.append([name])
            last = layer
    return Once(layout.compute, layout.reduce, tuple(tuple(b) for b in out), tuple(experts.items()),
                layout.ep.group_name if experts or stacked else "", layout.ep.shard_group if experts or stacked else "",
                stacked)


def cast_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype a parameter (or its gradient) travels in under mixed precision's ``dtype`` (the
    compute or the reduce dtype; None: its own): ``dtype`` for floating-point values."""
    return dtype if dtype is not None and t.is_floating_point() else t.dtype


def _waited(t: torch.Tensor) -> torch.Tensor:
    return funcol.wait_tensor(t) if isinstance(t, funcol.AsyncCollectiveTensor) else t


def _dp_dims(p: DTensor) -> list[int]:
    return [i for i, n in enumerate(p.device_mesh.mesh_dim_names) if n.startswith("dp")]


def _flat_shard(p: DTensor) -> tuple[int, int | None] | None:
    """(mesh dim sharded, mesh dim replicated or None) where ``p`` is split evenly along one
    tensor dim (``_shard_dim``) over one data-parallel mesh dim (and replicated over any other):
    its shards then travel in a flat bucket with others split over the same dims; None
    otherwise (gathered by itself through DTensor)."""
    dims = _dp_dims(p)
    shard = [i for i in dims if isinstance(p.placements[i], Shard)]
    rep = [i for i in dims if isinstance(p.placements[i], Replicate)]
    if len(shard) != 1 or len(shard) + len(rep) != len(dims):
        return None
    d = p.placements[shard[0]].dim
    if p._local_tensor.shape[d] * p.device_mesh.size(shard[0]) != _tp_local(p)[d]:
        return None
    return shard[0], rep[0] if rep else None


def _shard_dim(p: DTensor) -> int:
    """The tensor dim data parallelism splits ``p`` along (one where ``_flat_shard`` holds)."""
    return next(p.placements[i].dim for i in _dp_dims(p) if isinstance(p.placements[i], Shard))


def _tp_local(p: DTensor) -> tuple:
    """``p``'s shape on this rank once whole over the data-parallel dims (its TP shard)."""
    shape = list(p.shape)
    for i, pl in enumerate(p.placements):
        if i not in _dp_dims(p) and isinstance(pl, Shard):
            shape[pl.dim] //= p.device_mesh.size(i)
    return tuple(shape)


# A bucket of a grouped linear's owned experts, and a 3-D expert parameter's (``StepWeights._buckets``).
EXPERTS = "experts"
STACKED = "stacked"


class StepWeights:
    """One step's parameters, gathered once, and their gradients, accumulated and reduced once.
    ``params``: name -> registered parameter (a DTensor sharded over the data-parallel dims);
    ``auto``: reduce at the end of each backward (the user's own loop, one microbatch per
    backward) instead of when the step says (``reduce``)."""

    def __init__(self, params: dict, once: Once, auto: bool = False):
        self.params, self.once, self.auto = params, once, auto
        self.whole: dict[str, torch.Tensor] = {}
        self.grads: dict[str, torch.Tensor] = {}
        self.queued = False
        self.buckets = self._buckets()

    def _buckets(self) -> list[tuple[list[str], object]]:
        """(names, how) of each collective: how is ``_flat_shard``'s answer (a flat bucket), None
        (one parameter through DTensor) or ``EXPERTS`` (a grouped linear's owned experts, whose
        dim FSDP splits them along is ``self.once.experts``'), restricted to ``params``."""
        out: list = []
        for names, _ in self.once.experts:
            if names[0] in self.params:
                out.append((list(names), EXPERTS))
        out += [([n], STACKED) for n in self.once.stacked if n in self.params]
        for b in self.once.buckets:
            names = [n for n in b if n in self.params]
            for key in dict.fromkeys((_flat_shard(self.params[n]), self.params[n].dtype) for n in names):
                same = [n for n in names if (_flat_shard(self.params[n]), self.params[n].dtype) == key]
                out += [([n], None) for n in same] if key[0] is None else [(same, key[0])]
        return out

    def _replicas(self, p: DTensor) -> list[int]:
        return [i for i in _dp_dims(p) if isinstance(p.placements[i], Replicate)]

    def gather(self) -> StepWeights:
        """Every parameter whole over the data-parallel dims (its TP placement kept): a bucket's
        shards in one all-gather, a parameter split otherwise through DTensor; a grouped linear's
        owned experts: every expert's shard sent to its owner in one all-to-all (and the pieces
        gathered over ``ep_shard_group``), each rank's parameters then holding what it received
        for them, ``(shard groups, *shard)``, which the step graph assembles into its own
        experts' whole weights (``ep.assembled``)."""
        pending = []
        with torch.no_grad():
            for names, how in self.buckets:
                ps = [self.params[n] for n in names]
                dtype = cast_dtype(ps[0], self.once.compute)
                if how is None:
                    (p,) = ps
                    whole = [Replicate() if i in _dp_dims(p) else pl for i, pl in enumerate(p.placements)]
                    pending.append((names, how, p.to(dtype).redistribute(p.device_mesh, whole).to_local()))
                elif how is STACKED:
                    t = ps[0]._local_tensor.to(dtype)
                    if self.once.ep_shard_group:
                        t = funcol.all_gather_single(t, 0, self.once.ep_shard_group)
                    pending.append((names, how, t))
                elif how is EXPERTS:
                    stacked = torch.stack([p._local_tensor.to(dtype) for p in ps])
                    t = funcol.all_to_all_single(stacked, None, None, self.once.ep_group)
                    if self.once.ep_shard_group:
                        t = funcol.all_gather_single(_waited(t), 0, self.once.ep_shard_group)
                    pending.append((names, how, t))
                else:
                    flat = torch.cat([p._local_tensor.to(dtype).reshape(-1) for p in ps])
                    pending.append((names, how, funcol.all_gather_single(flat, 0, ps[0].device_mesh.get_group(how[0]))))
            pending.reverse()
            while pending:  # each gathered buffer freed once copied out of
                names, how, t = pending.pop()
                t = _waited(t)
                if how is None or how is STACKED:
                    self.whole[names[0]] = t
                elif how is EXPERTS:
                    # (shard groups, E, *shard) -> each expert's pieces, contiguous as the graph takes them
                    t = t.view(-1, len(names), *t.shape[1:]).movedim(1, 0).contiguous()
                    self.whole.update(zip(names, t.unbind(0)))
                else:
                    ps = [self.params[n] for n in names]
                    W = ps[0].device_mesh.size(how[0])
                    t, off = t.view(W, -1), 0
                    for n, p in zip(names, ps):
                        k = p._local_tensor.numel()
                        part = t[:, off:off + k].view(W, *p._local_tensor.shape)
                        self.whole[n] = part.movedim(0, _shard_dim(p)).reshape(_tp_local(p)).contiguous()
                        off += k
        return self

    def accumulators(self, runner) -> list[torch.Tensor]:
        """The buffers ``runner``'s backward adds its parameters' gradients into (in the order it
        takes them: ``runner.accumulate``), made (zeros, in the reduce dtype) at the step's first
        backward."""
        out = []
        for j in runner.accumulate:
            name = runner.param_names[runner.grad_index[j]]
            if name not in self.grads:
                p = self.params[name]
                self.grads[name] = torch.zeros(self.whole[name].shape, dtype=cast_dtype(p, self.once.reduce),
                                               device=self.whole[name].device)
            out.append(self.grads[name])
        return out

    def queue_reduce(self) -> None:
        """In a backward: reduce when autograd's backward pass ends (``auto``)."""
        if self.auto and not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.reduce)

    def reduce(self) -> None:
        """Each accumulated gradient reduced to its parameter's shard (a bucket's in one
        reduce-scatter, then one all-reduce over the replicas; owned experts' sent back to the
        shards' ranks in one all-to-all, no sum: only the owner computed them, then all-reduced
        over the replicas), added to ``param.grad``."""
        pending = []
        self.whole = {}  # the step's graphs are done with them
        with torch.no_grad():
            for names, how in self.buckets:
                names = [n for n in names if n in self.grads]
                if not names:
                    continue
                grads = [self.grads.pop(n) for n in names]  # each buffer freed once its collective has it
                ps = [self.params[n] for n in names]
                mesh = ps[0].device_mesh
                if how is None:
                    (p,) = ps
                    partial = [Partial("sum") if i in _dp_dims(p) else pl for i, pl in enumerate(p.placements)]
                    d = DTensor.from_local(grads[0], mesh, partial, run_check=False,
                                           shape=p.shape, stride=p.stride())
                    pending.append((names, d.redistribute(mesh, p.placements).to_local()))
                    continue
                parts: list = []
                if how is STACKED:  # this rank's experts' gradients: its piece summed over its shard group
                    t = (funcol.reduce_scatter_single(grads[0], "sum", 0, self.once.ep_shard_group)
                         if self.once.ep_shard_group else grads[0])
                elif how is EXPERTS:  # (shard groups, E, *shard): summed over the groups, each its own back
                    t = torch.stack(grads, 1)
                    t = (funcol.reduce_scatter_single(t.flatten(0, 1), "sum", 0, self.once.ep_shard_group)
                         if self.once.ep_shard_group else t[0])
                    t = funcol.all_to_all_single(_waited(t), None, None, self.once.ep_group).reshape(-1)
                else:
                    W = mesh.size(how[0])
                    for g, d in zip(grads, map(_shard_dim, ps)):
                        parts.append(g.view(*g.shape[:d], W, g.shape[d] // W, *g.shape[d + 1:]).movedim(d, 0).reshape(W, -1))
                    t = funcol.reduce_scatter_single(torch.cat(parts, dim=1).reshape(-1), "sum", 0,
                                                     mesh.get_group(how[0]))
                del grads, parts
                for r in self._replicas(ps[0]):
                    t = funcol.all_reduce(t, "sum", mesh.get_group(r))
                pending.append((names, t))
            self.grads = {}
            pending.reverse()
            while pending:
                names, t = pending.pop()
                t, off = _waited(t).reshape(-1), 0
                for n in names:
                    p = self.params[n]
                    k = p._local_tensor.numel()
                    local = t[off:off + k].view(p._local_tensor.shape).to(p.dtype)
                    off += k
                    if p.grad is None:
                        p.grad = DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                                    shape=p.shape, stride=p.stride())
                    else:
                        p.grad._local_tensor.add_(local)
        self.queued = False

    def _held_numel(self, names: list[str], how) -> int:
        """Elements a bucket holds whole on this rank (owned experts: what their collectives received)."""
        ps = [self.params[n] for n in names]
        mine = how in (EXPERTS, STACKED)
        k = _resolve_process_group(self.once.ep_shard_group).size() if mine and self.once.ep_shard_group else 1
        return sum(p._local_tensor.numel() * k if mine else math.prod(_tp_local(p)) for p in ps)

    def held(self) -> dict:
        """Bytes a step holds outside its graphs: the gathered parameters and their whole
        gradients (in the reduce dtype), by kind."""
        params = grads = 0
        for names, how in self.buckets:
            p = self.params[names[0]]
            k = self._held_numel(names, how)
            params += k * cast_dtype(p, self.once.compute).itemsize
            grads += k * cast_dtype(p, self.once.reduce).itemsize if p.requires_grad else 0
        return {"parameters gathered once per step": params, "whole gradients accumulated": grads}

    def records(self) -> list[dict]:
        """Each collective ``gather`` and ``reduce`` run, as ``passes.collective_record`` records
        a graph's (bytes and dtype of the result), for ``explain``."""
        out = []
        for names, how in self.buckets:
            p = self.params[names[0]]
            mesh = p.device_mesh
            whole = self._held_numel(names, how)
            local = sum(self.params[n]._local_tensor.numel() for n in names)
            gathered, reduced = cast_dtype(p, self.once.compute), cast_dtype(p, self.once.reduce)
            common = {"source": names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}", "module": ""}

            def rec(graph: str, kind: str, d, nbytes: int, dtype: torch.dtype, what: str) -> dict:
                """``d``: the mesh dim of the collective's group, or (a group's name, what it is)."""
                group = {"group": d[0], "dim": d[1], "group_size": _resolve_process_group(d[0]).size()} if isinstance(
                    d, tuple) else {
                    "group": mesh.get_group(d).group_name, "group_size": mesh.size(d), "dim": mesh.mesh_dim_names[d]}
                return {"graph": graph, "kind": kind, **group, "bytes": nbytes, "dtype": str(dtype).removeprefix("torch."),
                        "pass": what, **common}

            if how is STACKED:
                if self.once.ep_shard_group:
                    mod = (self.once.ep_shard_group, "dp_shard / ep")
                    out += [rec("before the step", "all_gather_into_tensor", mod, whole * gathered.itemsize, gathered, "ep"),
                            rec("after the step", "reduce_scatter_tensor", mod, whole * reduced.itemsize, reduced, "ep")]
            elif how is EXPERTS:
                ep = (self.once.ep_group, "ep")
                out += [rec("before the step", "all_to_all_single", ep, local * gathered.itemsize, gathered, "ep"),
                        rec("after the step", "all_to_all_single", ep, local * reduced.itemsize, reduced, "ep")]
                if self.once.ep_shard_group:
                    mod = (self.once.ep_shard_group, "dp_shard / ep")
                    out += [rec("before the step", "all_gather_into_tensor", mod, whole * gathered.itemsize, gathered, "ep"),
                            rec("after the step", "reduce_scatter_tensor", mod, whole * reduced.itemsize, reduced, "ep")]
            else:
                shard = [how[0]] if how else [i for i in _dp_dims(p) if not isinstance(p.placements[i], Replicate)]
                for d in shard:
                    out.append(rec("before the step", "all_gather_into_tensor", d, whole * gathered.itemsize, gathered,
                                   "fsdp"))
                    out.append(rec("after the step", "reduce_scatter_tensor", d, local * reduced.itemsize, reduced,
                                   "fsdp"))
            for d in self._replicas(p):
                out.append(rec("after the step", "all_reduce", d, local * reduced.itemsize, reduced, "ddp"))
        return out


@contextlib.contextmanager
def once_per_step(runners: list, params: dict, once: Once):
    """Gather ``params`` for ``runners`` (``StepRunner``s), run the body (the step's
    microbatches), reduce the gradients once. Nothing is reduced when the body raises."""
    weights = StepWeights(params, once).gather()
    for r in runners:
        r.once = weights
    try:
        yield weights
        weights.reduce()
    finally:
        for r in runners:
            r.once = None
        weights.whole, weights.grads = {}, {}
