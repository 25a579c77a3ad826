"""The step passes run once for the ranks that would make the same graphs, and kept for the next run.

The passes (distribute's DTensor replay above all) take each rank seconds, minutes on a deep
model, and SPMD ranks make the same graphs: a rank's coordinate is read at run time
(``passes/coords.py``) and process groups are named by their place in the mesh
(``passes/groups.py``). So with several processes, the first rank of each set whose passes take
the same inputs runs them, noting every read of its place in the mesh (``coords.recording``);
it stores the graphs, their notes and what the runtime needs from them under a digest of those
inputs (the step graph with its annotations and shapes, the plan, the mesh, the layout and TP
rules, the example shapes, torch and autopar's code) with the ranks its reads agree on; the
other ranks wait for it and load them, or, where a read differs for them (a sequence split's
offsets under CP, an uneven last shard), run the passes themselves. Inductor's cache then
serves the compiled code the same way (``backend.compile_step``).

The store is a directory in autopar's cache (``AUTOPAR_CACHE_DIR``), shared by a machine's
ranks: the next run with the same inputs loads its graphs without running a pass.
``AUTOPAR_SHARED_PASSES=0`` runs the passes on every rank; ``=check`` also runs them on the
ranks that load and fails where the loaded graphs differ from their own (slow: for tests).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import glob
import hashlib
import json
import logging
import os
import time

import torch

from autopar.errors import AutoparError
from autopar.passes import PassContext, StepGraphs, ac, run_passes

log = logging.getLogger(__name__)

# Node annotations not kept with the stored graphs (they hold the model's classes and
# functions, and nothing after the passes reads them); removed on every rank, so the graphs a
# rank compiles are the ones it stores.
_DROPPED_META = ("nn_module_stack", "source_fn_stack", "fwd_source_fn_stack")


def run_step_passes(sg, ctx: PassContext, passes: list) -> StepGraphs:
    """``run_passes(sg.gm, ctx, passes)``, run on one rank of each set with the same inputs
    where there are several processes (see the module's docstring)."""
    import torch.distributed as dist

    mode = os.environ.get("AUTOPAR_SHARED_PASSES", "1")
    if mode == "0" or not (dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "fake"):
        return run_passes(sg.gm, ctx, passes)
    import socket

    from autopar.passes import groups

    groups.register(ctx.mesh)  # the names the stored graphs' collectives use, on every rank
    key = step_key(sg, ctx)
    keys: list = [None] * dist.get_world_size()
    dist.all_gather_object(keys, (key, socket.gethostname()))
    me = dist.get_rank()
    first = keys.index(keys[me]) == me
    store = os.path.join(_cache_dir(), "passes", key)

    def own(save: bool = True) -> StepGraphs:
        from autopar.passes import coords

        with coords.recording() as reads:
            graphs = run_passes(sg.gm, ctx, passes)
        _drop_meta(graphs)
        if save:
            _save(store, graphs, ctx, reads)
        return graphs

    if first:
        try:
            graphs = _load(store, me, ctx) or own()
        finally:
            dist.barrier()  # also when the passes failed: the others then meet the same error
        return graphs
    dist.barrier()
    loaded = _load(store, me, ctx)
    if loaded is None:
        return own()
    if mode == "check":
        _same_graphs(loaded, own(save=False), me)
    return loaded


def step_key(sg, ctx: PassContext) -> str:
    """A digest of everything the step passes take, except this rank's place in the mesh."""
    state = ctx.step
    h = hashlib.sha256()
    h.update(torch.__version__.encode())
    h.update(_code())
    step_digest(h, sg)
    mesh = ctx.mesh
    h.update(repr((mesh.device_type, mesh.mesh_dim_names, mesh.mesh.tolist())).encode())
    env = sorted((k, v) for k, v in os.environ.items()
                 if k.startswith("AUTOPAR_") and k not in ("AUTOPAR_QUIET", "AUTOPAR_CACHE_DIR", "AUTOPAR_SHARED_PASSES"))
    h.update(repr(canonical([ctx.plan, ctx.compile, sorted(ctx.disabled), state.layout, state.rules, state.example,
                             state.n_outputs, state.dp, state.split_weight, state.accumulate, env])).encode())
    return h.hexdigest()[:32]


def step_digest(h, step) -> None:
    """Add to ``h`` what a traced step is: each node of its graph (operation, arguments,
    annotations, its values' shapes) and the step's bookkeeping."""

    def sig(v):
        if isinstance(v, torch.Tensor):
            return (tuple(map(str, v.shape)), tuple(map(str, v.stride())), str(v.dtype), v.requires_grad)
        return str(v) if isinstance(v, (torch.SymInt, torch.SymFloat, int, float, bool)) else type(v).__name__

    for n in step.gm.graph.nodes:
        vals = [sig(v) for v in torch.utils._pytree.tree_leaves(n.meta.get("val"))]
        h.update(repr((n.op, n.name, str(n.target), n.args, n.kwargs, n.meta.get("custom"), n.meta.get("trained"),
                       vals)).encode())
    h.update(repr([getattr(step, f.name) for f in dataclasses.fields(step) if f.name != "gm"]).encode())


def canonical(x, depth: int = 0):
    """``x`` as plain values that say the same on every rank: a mesh by its dims and shape (which
    ranks it holds is this rank's place, noted where a pass reads it), a process group by its
    size and its name by the name every rank gives it (``passes/groups.py``), a tensor by its shape, strides, dtype and whether it needs a gradient, a graph node by
    its name, an object by its class and fields."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.placement_types import Placement

    from autopar.passes.groups import _ALIAS

    if isinstance(x, str):
        return _ALIAS.get(x, x)  # a process group's name: the one every rank gives it
    if isinstance(x, (int, float, bool, type(None))):
        return x
    if isinstance(x, (torch.dtype, torch.device, enum.Enum, Placement)):
        return repr(x)
    if isinstance(x, DeviceMesh):
        return ("mesh", x.device_type, tuple(x.mesh_dim_names or ()), tuple(x.shape))
    if isinstance(x, torch.distributed.ProcessGroup):
        return ("group", x.size())
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), tuple(x.stride()), str(x.dtype), x.requires_grad, x.device.type)
    if isinstance(x, torch.fx.Node):
        return ("node", x.name)
    if isinstance(x, (torch.fx.GraphModule, torch.fx.Graph)):
        return ("graph",)  # the step graph: in ``step_digest``
    if isinstance(x, dict):
        return ("dict", sorted(((repr(canonical(k, depth + 1)), canonical(v, depth + 1)) for k, v in x.items()),
                               key=lambda kv: kv[0]))
    if isinstance(x, (set, frozenset)):
        return ("set", sorted(repr(canonical(v, depth + 1)) for v in x))
    if isinstance(x, (list, tuple)):
        return tuple(canonical(v, depth + 1) for v in x)
    if callable(x) and hasattr(x, "__qualname__"):
        return ("callable", getattr(x, "__module__", ""), x.__qualname__)
    name = f"{type(x).__module__}.{type(x).__qualname__}"
    if depth > 8:
        return name
    if dataclasses.is_dataclass(x):
        return (name, tuple((f.name, canonical(getattr(x, f.name), depth + 1)) for f in dataclasses.fields(x)))
    if hasattr(x, "__dict__"):
        return (name, canonical(vars(x), depth + 1))
    return (name, repr(x))


@functools.lru_cache(maxsize=1)
def _code() -> bytes:
    """autopar's source: a change to any module may change what the passes make."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    h = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True)):
        with open(path, "rb") as f:
            h.update(path[len(root):].encode() + f.read())
    return h.digest()


def _cache_dir() -> str:
    from autopar import models

    return models.cache_dir()


def _graph_modules(graphs: StepGraphs):
    for f in dataclasses.fields(graphs):
        gm = getattr(graphs, f.name)
        if isinstance(gm, torch.fx.GraphModule):
            yield from (m for m in gm.modules() if isinstance(m, torch.fx.GraphModule))


def _drop_meta(graphs: StepGraphs) -> None:
    for gm in _graph_modules(graphs):
        for n in gm.graph.nodes:
            for k in _DROPPED_META:
                n.meta.pop(k, None)


def _save(store: str, graphs: StepGraphs, ctx: PassContext, reads) -> None:
    """The graphs, the passes' notes and the runtime's accumulate list, for the ranks ``reads``
    agrees on (written whole, then renamed: a reader never sees half a file)."""
    from torch._guards import detect_fake_mode
    from torch.fx._graph_pickler import Options

    from autopar.passes import graph_pickle

    ranks = sorted(reads.ranks())
    name = hashlib.sha256(repr(ranks).encode()).hexdigest()[:16]
    fake = detect_fake_mode([n.meta.get("val") for n in graphs.fw.graph.find_nodes(op="placeholder")])
    mode = {"allow_non_fake_inputs": bool(getattr(fake, "allow_non_fake_inputs", True))}
    unseeded = ac.unseeded_sources(n.target for gm in _graph_modules(graphs) for n in gm.graph.nodes)
    try:
        data = graph_pickle.Pickler.dumps({"graphs": graphs, "notes": ctx.notes, "accumulate": ctx.step.accumulate},
                                  Options(ops_filter=None))
    except Exception as e:  # noqa: BLE001 - a graph that does not pickle: every rank runs the passes
        log.warning("shared passes: the step graphs do not pickle (%s: %s); other ranks run the passes",
                    type(e).__name__, e)
        return
    os.makedirs(store, exist_ok=True)
    for suffix, payload in ((".pkl", data), (".json", json.dumps({"ranks": ranks, "fake_mode": mode, "unseeded": unseeded}).encode())):
        tmp = os.path.join(store, f".{name}{suffix}.{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(payload)
        os.replace(tmp, os.path.join(store, name + suffix))


def _load(store: str, rank: int, ctx: PassContext) -> StepGraphs | None:
    """The stored graphs valid on ``rank`` (their notes and accumulate list into ``ctx``), or None."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx._graph_pickler import GraphPickler
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    t0 = time.perf_counter()
    for meta in sorted(glob.glob(os.path.join(store, "*.json"))):
        try:
            with open(meta) as f:
                header = json.load(f)
            if rank not in header["ranks"]:
                continue
            with open(meta[: -len(".json")] + ".pkl", "rb") as f:
                data = f.read()
        except (OSError, ValueError, KeyError):
            continue
        try:
            ac.define_unseeded(header.get("unseeded", []))  # operators the AC pass defines as it runs
            entry = GraphPickler.loads(data, FakeTensorMode(shape_env=ShapeEnv(), **header["fake_mode"]))
        except Exception as e:  # noqa: BLE001 - written by another version of a library: run the passes
            log.warning("shared passes: %s does not load (%s: %s)", meta, type(e).__name__, e)
            return None
        for k, lines in entry["notes"].items():
            ctx.notes.setdefault(k, []).extend(lines)
        ctx.step.accumulate = entry["accumulate"]
        ctx.timings["passes (loaded)"] = time.perf_counter() - t0
        return entry["graphs"]
    return None


def _same_graphs(loaded: StepGraphs, own: StepGraphs, rank: int) -> None:
    """``AUTOPAR_SHARED_PASSES=check``: the loaded graphs are the ones this rank makes (code and
    constants)."""

    def text(gm):
        mods = [m for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]
        consts = [str(getattr(m, n.target)) for m in mods for n in m.graph.find_nodes(op="get_attr")
                  if isinstance(getattr(m, n.target, None), torch.Tensor)]
        return [m.code for m in mods], consts

    for f in dataclasses.fields(own):
        a, b = getattr(loaded, f.name), getattr(own, f.name)
        same = text(a) == text(b) if isinstance(b, torch.fx.GraphModule) else a == b
        if not same:
            raise AutoparError(f"shared passes: rank {rank}'s {f.name} differs from what it loaded "
                               "(a read of its place in the mesh was not noted)")
