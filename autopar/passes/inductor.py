"""Inductor: compile each block in place (``nn.Module.compile`` keeps parameter names), after TP
and AC and before FSDP, as torchtitan orders it. With TP but no FSDP the whole model compiles as
one graph instead (per-block compile breaks in backward under SP on PyTorch 2.13). The choice is
recorded in the provenance, so ``explain`` says what ran compiled.
"""

from __future__ import annotations

import torch.nn as nn

from autopar.passes import PassContext
from autopar.passes.pp import is_real_block


def apply_compile(model: nn.Module, ctx: PassContext) -> nn.Module:
    if not ctx.compile:
        ctx.record("compile", "off (compile=False): eager")
        return model
    plan = ctx.plan
    if plan.tp > 1 and not (plan.fsdp and plan.dp > 1) and plan.pp == 1:
        model.compile()
        ctx.record("compile", "whole model compiled by Inductor")
        return model
    mods = dict(model.named_modules())
    for layer in plan.layers:
        if layer.fqn in mods and is_real_block(mods[layer.fqn]):
            mods[layer.fqn].compile()
            ctx.record("compile", f"{layer.fqn}: compiled by Inductor")
    return model
