"""Process groups named by their place in the mesh, the same on every rank.

torch names a process group by a counter, so the tensor-parallel group of ranks 0-1 and that of
ranks 2-3 have different names, and the collectives of two SPMD ranks' graphs differ only in that
string. Named instead by mesh dim and a digest of the mesh's ranks (``autopar:tp:<digest>``),
registered on each rank for its own group of that dim, the graphs of SPMD ranks are the same
text: Inductor's cache key is the same, and ``backend.compile_step`` compiles them once per
machine (the first rank with them; the others load its code). A TP rank's coordinate is read
at run time (``passes/coords.py``), so TP ranks share their graphs too; ranks whose graphs
really differ (pipeline stages, a sequence split's offsets and swap partners under CP, an
uneven last shard) compile their own.
"""

from __future__ import annotations

import torch

from autopar.fxops import COLLECTIVES, op_name
from autopar.passes import StepGraphs

PREFIX = "autopar:"
_ALIAS: dict[str, str] = {}  # torch's name of a process group -> the name the graphs use
_DIM: dict[str, str] = {}  # either name -> the mesh dim it is the group of
_NAMED = (*COLLECTIVES, "group_rank")  # the ops whose last argument is a group's name (coords.group_rank)


def mesh_dims(mesh) -> list[str]:
    """The mesh's dims and the flattened dims made from it (``dp_shard_cp``)."""
    root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else mesh
    return list(mesh.mesh_dim_names or ()) + sorted(getattr(root, "_flatten_mapping", {}) or {})


def register(mesh) -> None:
    """Register each group of ``mesh`` under a name every rank gives it: the dim and a digest of
    the mesh's ranks, so one name always means the same sets of ranks (in this process, across
    launches and processes: Inductor's cache serves them all). A later mesh of the same ranks
    takes the name over (its groups are the same ranks: graphs compiled for the earlier one run
    on it just as well, and a destroyed earlier mesh leaves nothing behind)."""
    named = set()  # a flattened dim of one mesh dim's size is that dim's group: named by the mesh dim
    for d in mesh_dims(mesh):
        try:
            pg = mesh.get_group(d)
        except (KeyError, RuntimeError, ValueError):  # a flattened dim of another part of the root mesh
            continue
        _name(pg, d, f"{PREFIX}{d}:{_digest(mesh)}", named)


def register_group(mesh, dim: str, pg) -> None:
    """Register ``pg``, this rank's group of a split of ``mesh``'s ranks that is not one of its dims
    (expert parallelism's ``ep`` ranks, carved out of the data-parallel ones), as ``register``
    does, under ``dim`` (which says the split: e.g. ``ep4``)."""
    _name(pg, dim, f"{PREFIX}{dim}:{_digest(mesh)}", set())


def _digest(mesh) -> str:
    import hashlib

    return hashlib.sha256(str(mesh.mesh.tolist()).encode()).hexdigest()[:8]


def _name(pg, d: str, alias: str, named: set) -> None:
    from torch._C._distributed_c10d import _register_process_group, _unregister_process_group
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        if _resolve_process_group(alias) is pg:
            named.add(pg.group_name)
            return
        _unregister_process_group(alias)
    except (KeyError, RuntimeError, ValueError):
        pass
    _register_process_group(alias, pg)
    _DIM[alias] = d
    if pg.group_name not in named:
        named.add(pg.group_name)
        _ALIAS[pg.group_name] = alias
        _DIM[pg.group_name] = d


def dim_of(group_name: str) -> str | None:
    """The mesh dim whose group ``group_name`` is (torch's name or autopar's), None if unknown."""
    return _DIM.get(group_name)


def rank_agnostic_groups(graphs: StepGraphs, plan, ctx) -> StepGraphs:
    """The pass: every collective of the step's graphs (layer subgraphs included) names its
    group by mesh dim (``register``)."""
    if ctx.mesh is None:
        return graphs
    register(ctx.mesh)
    seen = set()
    for g in (graphs.fw, graphs.bw, graphs.bw_input, graphs.bw_weight, graphs.fw_regions, graphs.bw_regions,
              graphs.bw_input_regions, graphs.bw_weight_regions):
        if g is None:
            continue
        for sub in g.modules():
            if not isinstance(sub, torch.fx.GraphModule) or id(sub) in seen:
                continue
            seen.add(id(sub))
            changed = False
            for n in sub.graph.nodes:
                if n.op == "call_function" and op_name(n.target) in _NAMED and n.args[-1] in _ALIAS:
                    n.args = (*n.args[:-1], _ALIAS[n.args[-1]])
                    changed = True
            if changed:
                sub.recompile()
    return graphs
