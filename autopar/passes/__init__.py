"""Passes that apply a Plan to a model, one file per transform, each ``(module, plan, ctx) -> module``.

The runner applies them in the order the transforms require (torchtitan's order): pipeline split,
tensor/sequence parallel, activation checkpointing, compile, then FSDP. Each pass records what it
did in ``ctx.provenance`` (pass name -> list of lines), so ``ParallelModule.explain(graph=True)``
can say which pass produced which collective or wrapper. Passes use PyTorch's own machinery
(DTensor ``parallelize_module``, ``fully_shard``, ``torch.utils.checkpoint``, ``torch.compile``)
from inside, driven only by the plan's rules, never by model-specific names.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

import torch.nn as nn

from autopar.errors import AutoparError
from autopar.plan import Plan

log = logging.getLogger(__name__)


@dataclass
class PassContext:
    mesh: object  # the 4-D DeviceMesh (pp, dp_replicate, dp_shard, tp)
    plan: Plan
    compile: bool = True
    provenance: dict = field(default_factory=dict)
    disabled: set = field(default_factory=set)

    def record(self, pass_name: str, line: str) -> None:
        self.provenance.setdefault(pass_name, []).append(line)


Pass = Callable[[nn.Module, PassContext], nn.Module]


def run_passes(module: nn.Module, ctx: PassContext, passes: list[tuple[str, Pass]]) -> nn.Module:
    done = []
    for name, fn in passes:
        if name in ctx.disabled:
            ctx.record(name, "disabled by the user")
            continue
        t0 = time.perf_counter()
        try:
            out = fn(module, ctx)
        except AutoparError:
            raise
        except Exception as e:
            raise AutoparError(
                f"pass {name!r} failed after {', '.join(done) or 'no other pass'}: {type(e).__name__}: {e}"
            ) from e
        if not isinstance(out, nn.Module):
            raise AutoparError(f"pass {name!r} returned {type(out).__name__}, not an nn.Module")
        module = out
        done.append(name)
        log.info("pass %s: %.2fs", name, time.perf_counter() - t0)
    return module
