"""Graph passes: each is a function ``(gm, plan, ctx) -> gm`` over the traced training step.

The order (``api.compile`` runs it):

1. ``distribute`` (``passes/distribute.py``): replays the single-device forward graph on
   DTensors placed as the plan says (TP/SP per operator from ``passes/tp.py``, FSDP/HSDP/DDP
   per parameter from ``passes/fsdp.py``, each parameter read where it is first used) under
   ``make_fx``, with the gradients taken by autograd: the result is one *joint* graph of forward
   and backward on local tensors with every collective explicit (``_c10d_functional``).
2. ``ac`` (``passes/ac.py``): tags forward nodes per layer for recomputation (full/selective)
   and, for ZeRO-3, the parameter all-gathers, in the joint graph.
3. ``partition`` (``backend.py``): splits the joint graph into forward and backward graphs
   (min-cut partitioner, which honours the tags).
4. ``overlap`` (``passes/overlap.py``): on each of the two graphs, the data-parallel collectives
   in per-layer buckets, gathered just before use and prefetched one layer ahead, gradients
   reduced as each layer's are complete.
5. Inductor compiles each graph whole (``backend.py``), keeping the order the passes chose;
   ``compile=False`` runs the very same graphs eagerly. ``memory.py`` walks those graphs for the
   step's peak memory.

Every node a pass adds carries ``node.meta["custom"]["pass"]`` (which pass made it) and, for
nodes replayed from the single-device graph, ``"source"`` (the node it came from), so
``explain`` can list each collective with its origin. The runner checks that each pass
returns a ``GraphModule``, times it, and names the failing pass and the ones before it.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from autopar.capture import op_name
from autopar.errors import AutoparError
from autopar.plan import Plan

log = logging.getLogger(__name__)

# The annotation of a column group's input gathered under TP (the AC pass gathers it again).
GATHERED_INPUT = "column input gathered"
COLLECTIVES = ("all_gather_into_tensor", "all_gather_into_tensor_out", "all_gather_into_tensor_coalesced",
               "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced", "all_reduce", "all_to_all_single")


@dataclass
class PassContext:
    mesh: Any  # the 4-D DeviceMesh (pp, dp_replicate, dp_shard, tp), None on one process
    plan: Plan
    compile: bool = True
    disabled: set = field(default_factory=set)
    timings: dict = field(default_factory=dict)
    notes: dict = field(default_factory=dict)  # pass name -> lines for explain
    # What the distribute pass needs beside the graph (api.StepState: the traced step, where each
    # parameter lives, the TP rules, the example primals).
    step: Any = None

    def note(self, pass_name: str, line: str) -> None:
        self.notes.setdefault(pass_name, []).append(line)


GraphPass = Callable[[torch.fx.GraphModule, Plan, PassContext], torch.fx.GraphModule]


def run_passes(gm: torch.fx.GraphModule, ctx: PassContext, passes: list[tuple[str, GraphPass]]) -> torch.fx.GraphModule:
    done: list[str] = []
    for name, fn in passes:
        if name in ctx.disabled:
            ctx.note(name, "disabled by the user")
            continue
        t0 = time.perf_counter()
        try:
            out = fn(gm, ctx.plan, ctx)
        except AutoparError:
            raise
        except Exception as e:
            raise AutoparError(
                f"pass {name!r} failed after {', '.join(done) or 'no other pass'}: {type(e).__name__}: {e}"
            ) from e
        if not isinstance(out, torch.fx.GraphModule):
            raise AutoparError(f"pass {name!r} returned {type(out).__name__}, not a torch.fx.GraphModule")
        ctx.timings[name] = time.perf_counter() - t0
        log.info("pass %s: %.2fs, ops %s", name, ctx.timings[name], _op_diff(gm, out))
        gm = out
        done.append(name)
    return gm


def _op_diff(before: torch.fx.GraphModule, after: torch.fx.GraphModule) -> str:
    a, b = count_ops(before), count_ops(after)
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
    nbytes = sum(v.numel() * v.element_size() for v in vals if isinstance(v, torch.Tensor))
    dtypes = sorted({str(v.dtype).removeprefix("torch.") for v in vals if isinstance(v, torch.Tensor)})
    custom = n.meta.get("custom", {})
    return {"kind": kind, "group": str(group), "group_size": size, "bytes": int(nbytes), "dtype": ",".join(dtypes),
            "pass": custom.get("pass", "?"), "source": custom.get("source", ""), "module": custom.get("module", "")}
