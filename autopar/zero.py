"""FSDP once per step (ZeRO-1, Megatron-LM's distributed optimizer), as autopar's runtime runs it.

Under ``Plan.fsdp_once == "gather"`` the parameters stay sharded between steps (what the optimizer
updates, what a checkpoint holds), but the step graphs read them whole (each rank's TP shard, in
the compute dtype) and return their gradients unreduced (``distribute.Layout.once``). Around the
step's microbatches the runtime then:

1. gathers every parameter once, before the first microbatch (all gathers issued, then waited);
2. runs the microbatches (or the pipeline schedule) on those whole parameters, adding each
   microbatch's gradients into one whole buffer per parameter in the reduce dtype;
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
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard


@dataclass(frozen=True)
class Once:
    """How a plan's step reads its parameters once per step: mixed precision's dtypes (None: the
    parameter's own) and the buckets, lists of parameter names (a layer's, the parameters before
    and after the layers), each gathered in one collective and reduced in one, as FSDP buckets
    them per layer in the graph (``passes/overlap.py``) and the cost model prices them."""

    compute: torch.dtype | None
    reduce: torch.dtype | None
    buckets: tuple


def plan_once(layout, graphs: list) -> Once | None:
    """``Once`` for a layout gathered once per step (None otherwise); ``graphs``: this rank's
    step graphs (a pipeline rank's stages), whose consecutive parameters of one repeated layer
    (or of none) make one bucket; a parameter two stages share is in the first one's."""
    from autopar import analysis

    if not layout.once:
        return None
    out: list[list[str]] = []
    seen: set = set()
    for sg in graphs:
        last = object()
        for name in sg.param_names:
            layer = analysis.layer_index(name, sg.layers)
            if name in seen:
                continue
            seen.add(name)
            if out and layer == last:
                out[-1].append(name)
            else:
                out.append([name])
            last = layer
    return Once(layout.compute, layout.reduce, tuple(tuple(b) for b in out))


def gathered_dtype(local: torch.Tensor, layout) -> torch.dtype:
    """The dtype a parameter is gathered in: the compute dtype (mixed precision), else its own."""
    if layout.compute is not None and local.is_floating_point():
        return layout.compute
    return local.dtype


def _waited(t: torch.Tensor) -> torch.Tensor:
    return funcol.wait_tensor(t) if isinstance(t, funcol.AsyncCollectiveTensor) else t


def _dp_dims(p: DTensor) -> list[int]:
    return [i for i, n in enumerate(p.device_mesh.mesh_dim_names) if n.startswith("dp")]


def _flat_shard(p: DTensor) -> tuple[int, int, int | None] | None:
    """(mesh dim sharded, tensor dim, mesh dim replicated or None) where ``p`` is split evenly
    along one tensor dim over one data-parallel mesh dim (and replicated over any other): its
    shards then travel in a flat bucket; None otherwise (gathered by itself through DTensor)."""
    dims = _dp_dims(p)
    shard = [i for i in dims if isinstance(p.placements[i], Shard)]
    rep = [i for i in dims if isinstance(p.placements[i], Replicate)]
    if len(shard) != 1 or len(shard) + len(rep) != len(dims):
        return None
    d = p.placements[shard[0]].dim
    local = p._local_tensor.shape
    if local[d] * p.device_mesh.size(shard[0]) != _tp_local(p)[d]:
        return None
    return shard[0], d, rep[0] if rep else None


def _tp_local(p: DTensor) -> tuple:
    """``p``'s shape on this rank once whole over the data-parallel dims (its TP shard)."""
    shape = list(p.shape)
    for i, pl in enumerate(p.placements):
        if i not in _dp_dims(p) and isinstance(pl, Shard):
            shape[pl.dim] //= p.device_mesh.size(i)
    return tuple(shape)


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

    def _buckets(self) -> list[list[str]]:
        """The plan's buckets restricted to ``params``, each split by how its parameters travel."""
        out = []
        for b in self.once.buckets:
            names = [n for n in b if n in self.params]
            for key in dict.fromkeys((_flat_shard(self.params[n]), self.params[n].dtype) for n in names):
                same = [n for n in names if (_flat_shard(self.params[n]), self.params[n].dtype) == key]
                if key[0] is None:
                    out += [[n] for n in same]
                else:
                    out.append(same)
        return out

    def held(self) -> dict:
        """Bytes a step holds outside its graphs: the gathered parameters and their whole
        gradients (in the reduce dtype), by kind."""
        whole = {n: math.prod(_tp_local(p)) for n, p in self.params.items()}
        return {"parameters gathered once per step": sum(
                    k * self._dtype(self.params[n], self.once.compute).itemsize for n, k in whole.items()),
                "whole gradients accumulated": sum(
                    k * self._dtype(self.params[n], self.once.reduce).itemsize for n, k in whole.items()
                    if self.params[n].requires_grad)}

    def records(self) -> list[dict]:
        """Each collective ``gather`` and ``reduce`` run, as ``passes.collective_record`` records
        a graph's (bytes and dtype of the result), for ``explain``."""
        out = []
        for names in self._buckets():
            ps = [self.params[n] for n in names]
            p, how = ps[0], _flat_shard(ps[0])
            mesh = p.device_mesh
            dims = [how[0]] if how else [i for i in _dp_dims(p) if not isinstance(p.placements[i], Replicate)]
            rep = [how[2]] if how and how[2] is not None else [] if how else [
                i for i in _dp_dims(p) if isinstance(p.placements[i], Replicate)]
            whole = sum(math.prod(_tp_local(q)) for q in ps)
            local = sum(q._local_tensor.numel() for q in ps)
            gathered, reduced = self._dtype(p, self.once.compute), self._dtype(p, self.once.reduce)
            common = {"source": names[0] if len(names) == 1 else f"{names[0]} .. {names[-1]}",
                      "module": ""}
            def at(d: int) -> dict:
                return {"group": mesh.get_group(d).group_name, "group_size": mesh.size(d),
                        "dim": mesh.mesh_dim_names[d]}

            for d in dims:
                out.append({"graph": "before the step", "kind": "all_gather_into_tensor", **at(d),
                            "bytes": whole * gathered.itemsize, "dtype": str(gathered).removeprefix("torch."), "pass": "fsdp", **common})
                out.append({"graph": "after the step", "kind": "reduce_scatter_tensor", **at(d),
                            "bytes": local * reduced.itemsize, "dtype": str(reduced).removeprefix("torch."), "pass": "fsdp", **common})
            for d in rep:
                out.append({"graph": "after the step", "kind": "all_reduce", **at(d),
                            "bytes": local * reduced.itemsize, "dtype": str(reduced).removeprefix("torch."), "pass": "ddp",
                            **common})
        return out

    def _dtype(self, p: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
        return dtype if dtype is not None and p.is_floating_point() else p.dtype

    def gather(self) -> StepWeights:
        """Every parameter whole over the data-parallel dims (its TP placement kept): a bucket's
        shards in one all-gather, a parameter split otherwise through DTensor."""
        pending = []
        with torch.no_grad():
            for names in self._buckets():
                ps = [self.params[n] for n in names]
                dtype = self._dtype(ps[0], self.once.compute)
                how = _flat_shard(ps[0])
                if how is None:
                    (p,) = ps
                    whole = [Replicate() if i in _dp_dims(p) else pl for i, pl in enumerate(p.placements)]
                    pending.append((names, None, p.to(dtype).redistribute(p.device_mesh, whole).to_local()))
                    continue
                flat = torch.cat([p._local_tensor.to(dtype).reshape(-1) for p in ps])
                group = ps[0].device_mesh.get_group(how[0])
                pending.append((names, how, funcol.all_gather_single(flat, 0, group)))
            for names, how, t in pending:
                t = _waited(t)
                if how is None:
                    self.whole[names[0]] = t
                    continue
                ps = [self.params[n] for n in names]
                W = ps[0].device_mesh.size(how[0])
                t, off = t.view(W, -1), 0
                for n, p in zip(names, ps):
                    k = p._local_tensor.numel()
                    part = t[:, off:off + k].view(W, *p._local_tensor.shape)
                    self.whole[n] = part.movedim(0, how[1]).reshape(_tp_local(p))
                    off += k
        return self

    def accumulate(self, name: str, g: torch.Tensor) -> None:
        """Add one microbatch's gradient of parameter ``name`` (whole, unreduced)."""
        acc = self.grads.get(name)
        if acc is None:
            self.grads[name] = g.to(self._dtype(self.params[name], self.once.reduce), copy=True)
        else:
            acc.add_(g)

    def queue_reduce(self) -> None:
        """In a backward: reduce when autograd's backward pass ends (``auto``)."""
        if self.auto and not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.reduce)

    def reduce(self) -> None:
        """Each accumulated gradient reduced to its parameter's shard (a bucket's in one
        reduce-scatter, then one all-reduce over the replicas), added to ``param.grad``."""
        pending = []
        with torch.no_grad():
            for names in self._buckets():
                names = [n for n in names if n in self.grads]
                if not names:
                    continue
                ps = [self.params[n] for n in names]
                how = _flat_shard(ps[0])
                if how is None:
                    (p,) = ps
                    partial = [Partial("sum") if i in _dp_dims(p) else pl for i, pl in enumerate(p.placements)]
                    d = DTensor.from_local(self.grads[names[0]], p.device_mesh, partial, run_check=False,
                                           shape=p.shape, stride=p.stride())
                    pending.append((names, d.redistribute(p.device_mesh, p.placements).to_local()))
                    continue
                mesh, W = ps[0].device_mesh, ps[0].device_mesh.size(how[0])
                parts = []
                for n in names:
                    g, d = self.grads[n], how[1]
                    parts.append(g.view(*g.shape[:d], W, g.shape[d] // W, *g.shape[d + 1:]).movedim(d, 0).reshape(W, -1))
                flat = torch.cat(parts, dim=1).reshape(-1)
                t = funcol.reduce_scatter_single(flat, "sum", 0, mesh.get_group(how[0]))
                if how[2] is not None:
                    t = funcol.all_reduce(t, "sum", mesh.get_group(how[2]))
                pending.append((names, t))
            self.grads = {}
            for names, t in pending:
                t, off = _waited(t), 0
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
        self.whole = {}
        self.queued = False


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
