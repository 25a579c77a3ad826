"""Graph passes: each is a function ``(value, plan, ctx) -> value`` over the traced training step,
registered as a ``Pass`` with what it takes and gives; ``run_passes`` runs a list of them.

The order (``step_passes``; ``api.compile`` runs it on each step graph):

0. ``pipeline split`` (``split_passes``, ``passes/pp.py``, pipeline plans only): the step graph
   cut into one step graph per pipeline stage; each then goes through the list below.
1. ``distribute`` (``passes/distribute.py``): replays the single-device forward graph on
   DTensors placed as the plan says (TP/SP per operator from ``passes/tp.py``, FSDP/HSDP/DDP
   per parameter from ``passes/fsdp.py``, each parameter read where it is first used; under CP
   the sequence split over ``cp`` and attention over gathered keys and values, ``passes/cp.py``) under
   ``make_fx``, with the gradients taken by autograd: the result is one *joint* graph of forward
   and backward on local tensors with every collective explicit (``_c10d_functional``). Each run
   of identical layers is replayed once and the rest copied (``passes/stamp.py``; switch ``stamp``).
2. ``ac`` (``passes/ac.py``): tags forward nodes per layer for recomputation (full/selective)
   and, for ZeRO-3, the parameter all-gathers (under CP, the key/value gathers), in the joint graph.
3. ``partition`` (``backend.py``): splits the joint graph into forward and backward graphs
   (min-cut partitioner, which honours the tags): a ``StepGraphs``.
4. ``overlap`` (``passes/overlap.py``, data-parallel plans): on each of the two graphs, the
   data-parallel collectives in per-layer buckets (``bucket``: one collective per bucket),
   gathered just before use and prefetched one layer ahead, gradients reduced as each layer's
   are complete.
5. ``zero-bubble split`` (``passes/pp.py``, zero-bubble schedules): the backward graph split
   into its input-gradient and weight-gradient parts.
6. ``regions`` (``passes/regions.py``): each repeated layer's compute as calls of one shared
   subgraph per distinct segment, so Inductor compiles each distinct layer once.
7. ``accumulate`` (``passes/accumulate.py``, parameters gathered once per step): each
   parameter's gradient added in place into the step's buffer for it where it is made.

With several processes, the passes run on the first rank of each set whose inputs are the same
and the others load the graphs it made (``shared.run_step_passes``: a rank's reads of its place
in the mesh are noted, so ranks that would make other graphs make their own); the graphs stay in
autopar's cache for the next run. Then Inductor compiles each graph whole
(``backend.compile_step``), keeping the order the passes chose; ``compile=False`` runs the very
same graphs eagerly. ``memory.py`` walks those graphs for
the step's peak memory.

Every node a pass adds carries ``node.meta["custom"]["pass"]`` (which pass made it) and, for
nodes replayed from the single-device graph, ``"source"`` (the node it came from), so
``explain`` can list each collective with its origin. The runner checks what each pass takes
and returns, times it, and names the failing pass and the ones before it.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from autopar.errors import AutoparError
from autopar.fxops import COLLECTIVES, op_name
from autopar.plan import Plan

log = logging.getLogger(__name__)

# The annotation of a column group's input gathered under TP (the AC pass gathers it again).
GATHERED_INPUT = "column input gathered"


@dataclass
class PassContext:
    mesh: Any  # the DeviceMesh (pp, dp_replicate, dp_shard, tp), None on one process
    plan: Plan
    compile: bool = True
    disabled: set = field(default_factory=set)
    timings: dict = field(default_factory=dict)
    notes: dict = field(default_factory=dict)  # pass name -> lines for explain
    # What the passes need beside the graph (api.StepState: the traced step, where each parameter
    # lives, the TP rules, the example primals, the data-parallel collectives to schedule).
    step: Any = None

    def note(self, pass_name: str, line: str) -> None:
        self.notes.setdefault(pass_name, []).append(line)


@dataclass
class StepGraphs:
    """The step after ``partition``: its forward graph ``(*primals) -> (*outputs, *saved)`` and
    backward graph ``(*saved, *tangents) -> gradients``; under a zero-bubble schedule also the
    backward's input-gradient part ``bw_input`` and weight-gradient part ``bw_weight``."""

    fw: torch.fx.GraphModule
    bw: torch.fx.GraphModule
    n_outputs: int
    bw_input: torch.fx.GraphModule | None = None
    bw_weight: torch.fx.GraphModule | None = None
    n_input_grads: int = 0
    # The same graphs with each repeated layer segment a call of a shared subgraph (``regions``):
    # what Inductor compiles where set; the flat ones are what memory.py walks and explain lists.
    fw_regions: torch.fx.GraphModule | None = None
    bw_regions: torch.fx.GraphModule | None = None
    bw_input_regions: torch.fx.GraphModule | None = None
    bw_weight_regions: torch.fx.GraphModule | None = None

    def to_compile(self, name: str) -> torch.fx.GraphModule:
        """Graph ``name`` (fw, bw, bw_input, bw_weight) as Inductor compiles it."""
        return getattr(self, f"{name}_regions") or getattr(self, name)


@dataclass(frozen=True)
class Pass:
    """One registered pass: ``fn(value, plan, ctx)`` takes a ``takes`` and returns a ``gives``;
    it runs where ``when(ctx)`` holds (every time without one); ``optional`` ones the user may
    turn off (``autopar.compile(disable_passes=...)``)."""

    name: str
    takes: type
    gives: type
    fn: Callable[[Any, Plan, PassContext], Any]
    when: Callable[[PassContext], bool] | None = None
    optional: bool = False


# What the user may turn off by name beside the optional passes: overlap's merging into buckets
# (one collective per parameter instead) and Inductor (the same graphs run eagerly).
SWITCHES = ("bucket", "inductor", "stamp")


def split_passes() -> list[Pass]:
    """What a pipeline plan runs first, on the whole step graph: the cut into stage graphs."""
    from autopar.capture import StepGraph
    from autopar.passes.pp import pipeline_split

    return [Pass("pipeline split", StepGraph, list, pipeline_split)]


def step_passes() -> list[Pass]:
    """The passes every step graph goes through, in order."""
    from autopar import backend
    from autopar.passes.ac import apply_ac
    from autopar.passes.accumulate import accumulate
    from autopar.passes.distribute import distribute
    from autopar.passes.groups import rank_agnostic_groups
    from autopar.passes.overlap import overlap
    from autopar.passes.pp import split_weight_gradients
    from autopar.passes.regions import regions

    G = torch.fx.GraphModule
    return [
        Pass("distribute", G, G, distribute),
        Pass("ac", G, G, apply_ac, optional=True),
        Pass("partition", G, StepGraphs, backend.partition),
        Pass("overlap", StepGraphs, StepGraphs, overlap, when=lambda ctx: ctx.step.dp is not None, optional=True),
        Pass("zero-bubble split", StepGraphs, StepGraphs, split_weight_gradients,
             when=lambda ctx: ctx.step.split_weight is not None),
        Pass("regions", StepGraphs, StepGraphs, regions, optional=True),
        Pass("accumulate", StepGraphs, StepGraphs, accumulate, when=lambda ctx: ctx.step.accumulate is not None),
        Pass("group names", StepGraphs, StepGraphs, rank_agnostic_groups),
    ]


def graph_module(root: torch.nn.Module, graph: torch.fx.Graph) -> torch.fx.GraphModule:
    """A pass's new graph as a module. Under ``autopar.compile`` (which runs under torch's
    ``_use_lazy_graph_module``) its Python code is generated only if it is run or read: the passes build and rewrite graphs that
    Inductor compiles from the graph itself, and making each one's code was a tenth of a 32-layer
    compile."""
    from torch.fx._lazy_graph_module import _make_graph_module

    return _make_graph_module(root, graph)


def check_pass_names(disable) -> set:
    """``disable_passes`` as a set, refused in words when it names what cannot be turned off."""
    can = {p.name for p in step_passes() if p.optional} | set(SWITCHES)
    names = {disable} if isinstance(disable, str) else set(disable)
    bad = sorted(names - can)
    if bad:
        raise AutoparError(f"disable_passes: {', '.join(map(repr, bad))} cannot be turned off; what can: "
                           f"{', '.join(sorted(can))}")
    return names


def run_passes(value: Any, ctx: PassContext, passes: list[Pass]) -> Any:
    """Run ``passes`` in order on ``value``: each checked to take and return what it declares,
    timed into ``ctx.timings``, a failure named with the passes that ran before it."""
    done: list[str] = []
    for p in passes:
        if p.when is not None and not p.when(ctx):
            continue
        if p.name in ctx.disabled:
            ctx.note(p.name, "disabled by the user")
            continue
        if not isinstance(value, p.takes):
            raise AutoparError(f"pass {p.name!r} takes a {p.takes.__name__}, got {type(value).__name__} "
                               f"(after {', '.join(done) or 'no other pass'})")
        before = _op_counts(value) if log.isEnabledFor(logging.INFO) else None  # passes may edit in place
        t0 = time.perf_counter()
        try:
            out = p.fn(value, ctx.plan, ctx)
        except AutoparError:
            raise
        except Exception as e:
            raise AutoparError(
                f"pass {p.name!r} failed after {', '.join(done) or 'no other pass'}: {type(e).__name__}: {e}"
            ) from e
        if not isinstance(out, p.gives):
            raise AutoparError(f"pass {p.name!r} returned {type(out).__name__}, not a {p.gives.__name__}")
        ctx.timings[p.name] = time.perf_counter() - t0
        if before is not None:
            log.info("pass %s: %.2fs, ops %s", p.name, ctx.timings[p.name], _op_diff(before, _op_counts(out)))
        value = out
        done.append(p.name)
    return value


def _graphs(value: Any) -> list[torch.fx.GraphModule]:
    if isinstance(value, torch.fx.GraphModule):
        return [value]
    if isinstance(value, StepGraphs):
        return [g for g in (value.fw, value.bw, value.bw_input, value.bw_weight) if g is not None]
    if isinstance(value, list):
        return [g for v in value for g in _graphs(getattr(v, "gm", v))]
    return []


def _op_counts(value: Any) -> Counter:
    return sum((count_ops(g) for g in _graphs(value)), Counter())


def _op_diff(a: Counter, b: Counter) -> str:
    diff = {k: b.get(k, 0) - a.get(k, 0) for k in set(a) | set(b) if b.get(k, 0) != a.get(k, 0)}
    return ", ".join(f"{k} {v:+d}" for k, v in sorted(diff.items())) or "unchanged"


def count_ops(gm: torch.fx.GraphModule) -> Counter:
    return Counter(op_name(n.target) for n in gm.graph.nodes if n.op == "call_function")


def collectives(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """The collective nodes of a graph, in order."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and op_name(n.target) in COLLECTIVES]


def collective_record(n: torch.fx.Node) -> dict:
    """kind, group size, bytes and dtype (of the result) and origin of one collective node."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    kind = op_name(n.target).removesuffix("_coalesced")  # a bucket: one collective on the wire
    group = n.args[-1]
    size = None
    try:
        size = _resolve_process_group(group).size()
    except Exception:
        size = n.args[1] if kind != "all_reduce" and isinstance(n.args[1], int) else None
    val = n.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    sizes = [v.numel() * v.element_size() for v in vals if isinstance(v, torch.Tensor)]
    # None: sized by the data (expert parallelism's routed rows), known only when it runs.
    nbytes = sum(sizes) if all(isinstance(b, int) for b in sizes) else None
    dtypes = sorted({str(v.dtype).removeprefix("torch.") for v in vals if isinstance(v, torch.Tensor)})
    from autopar.passes.overlap import DP_PASS

    custom = n.meta.get("custom", {})
    return {"kind": kind, "group": str(group), "group_size": size, "bytes": nbytes, "dtype": ",".join(dtypes),
            "pass": custom.get("pass") or n.meta.get(DP_PASS, "?"), "source": custom.get("source", ""), "module": custom.get("module", "")}
