"""Activation checkpointing per layer, as the plan says: ``full`` recomputes the whole block in
backward; ``selective`` saves the outputs of matmuls and attention kernels and recomputes the rest
(op-level selective AC, as torchtitan). The block's ``forward`` is wrapped in place, so parameter
names (and state_dict keys) do not change and the user wraps nothing.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from autopar.passes import PassContext
from autopar.passes.pp import is_real_block

_aten = torch.ops.aten
SAVE_OPS = {
    _aten.mm.default, _aten.addmm.default, _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default, _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _wrap(block: nn.Module, mode: str) -> None:
    inner = block.forward
    kw = {} if mode == "full" else {"context_fn": functools.partial(create_selective_checkpoint_contexts, _policy)}

    # A plain function, not a functools.partial: Dynamo compiles through a function but silently
    # runs a partial-of-checkpoint forward eagerly (no graph at all).
    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, **kw, **kwargs)

    block.forward = forward


def apply_ac(model: nn.Module, ctx: PassContext) -> nn.Module:
    mods = dict(model.named_modules())
    for layer in ctx.plan.layers:
        if layer.ac == "none" or layer.fqn not in mods or not is_real_block(mods[layer.fqn]):
            continue
        _wrap(mods[layer.fqn], layer.ac)
        ctx.record("ac", f"{layer.fqn}: {layer.ac} checkpoint")
    return model
