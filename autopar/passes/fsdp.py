"""FSDP (ZeRO-3) with FSDP2's ``fully_shard``: each block is one unit (all-gathered before use,
reduce-scattered after backward, resharded after forward per the plan), then the root for the
embedding and head. HSDP when the plan replicates: a 2-D (dp_replicate, dp_shard) mesh.
Mixed precision (bf16 compute, fp32 reduce and master weights) for bf16/fp16 plans.
Plans with data parallelism but no FSDP keep full replicas; the runtime all-reduces their
gradients after backward.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from autopar.passes import PassContext
from autopar.passes.pp import is_real_block


def apply_fsdp(model: nn.Module, ctx: PassContext) -> nn.Module:
    plan = ctx.plan
    if not plan.fsdp or plan.dp == 1:
        return model
    if plan.dp_shard == plan.dp:
        mesh = ctx.mesh["dp_shard"]
    else:
        mesh = ctx.mesh["dp_replicate", "dp_shard"]
    mp = None
    if plan.precision in ("bf16", "fp16"):
        dt = torch.bfloat16 if plan.precision == "bf16" else torch.float16
        mp = MixedPrecisionPolicy(param_dtype=dt, reduce_dtype=torch.float32)
    kw = {"mesh": mesh}
    if mp is not None:
        kw["mp_policy"] = mp
    mods = dict(model.named_modules())
    for layer in plan.layers:
        if layer.fqn in mods and is_real_block(mods[layer.fqn]):
            fully_shard(mods[layer.fqn], reshard_after_forward=plan.reshard_after_forward, **kw)
            ctx.record("fsdp", f"{layer.fqn}: fully_shard over {tuple(mesh.mesh.shape)}")
    fully_shard(model, reshard_after_forward=plan.reshard_after_forward, **kw)
    ctx.record("fsdp", f"root: fully_shard over {tuple(mesh.mesh.shape)}")
    return model
