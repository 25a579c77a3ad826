"""Tensor and sequence parallelism: DTensor styles per the plan's shard rules.

Without SP the residual stream is replicated: a column linear takes a replicated input and
keeps its output sharded by heads/features; the row linear all-reduces. With SP the residual
stream is split along the sequence: column linears all-gather their input, row linears
reduce-scatter their output, norms run on sequence shards (``SequenceParallel``), the vocabulary
embedding reduce-scatters and the vocabulary head all-gathers its logits.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module,
)

from autopar.errors import AutoparError
from autopar.passes import PassContext


def tp_styles(model: nn.Module, ctx: PassContext) -> dict:
    plan = ctx.plan
    seq = Shard(1) if plan.sp else Replicate()
    by_scope: dict[str, list] = {}
    for r in plan.shard_rules:
        by_scope.setdefault(r.scope, []).append(r)
    styles = {}

    def style(rule):
        if rule.style == "colwise":
            return ColwiseParallel(input_layouts=seq)
        if rule.style == "rowwise":
            return RowwiseParallel(output_layouts=seq)
        if rule.style == "sequence":
            return SequenceParallel() if plan.sp else None
        if rule.style == "vocab_embedding":
            # Whole output even under SP: models derive positions and masks from it (HF does);
            # the residual stream is split along the sequence at the first block instead.
            return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        if rule.style == "vocab_head":
            return ColwiseParallel(input_layouts=seq, output_layouts=Replicate())
        return None

    mods = dict(model.named_modules())
    for layer in plan.layers:
        block = mods.get(layer.fqn)
        if block is None:
            continue  # not on this pipeline stage
        for rule in by_scope.get(type(block).__name__, []):
            st = style(rule)
            if st is not None:
                styles[f"{layer.fqn}.{rule.module}"] = st
    for rule in by_scope.get("outside", []):
        st = style(rule)
        if st is not None and rule.module in mods:
            styles[rule.module] = st
    for name in styles:
        m = mods[name]
        if isinstance(styles[name], (ColwiseParallel, RowwiseParallel)) and not isinstance(m, (nn.Linear, nn.Embedding)):
            raise AutoparError(f"TP style for {name} needs nn.Linear or nn.Embedding, found {type(m).__name__}")
    return styles


def _shard_sequence_hook(tp_mesh):
    """Forward pre-hook: the block's hidden-state input (first tensor argument) goes from whole to
    split along the sequence (dim 1). Through DTensor, so backward all-gathers its gradient."""

    def hook(module, args, kwargs):
        if args and isinstance(args[0], torch.Tensor) and not isinstance(args[0], DTensor):
            h = DTensor.from_local(args[0], tp_mesh, [Replicate()], run_check=False)
            return (h.redistribute(tp_mesh, [Shard(1)]).to_local(), *args[1:]), kwargs
        if "hidden_states" in kwargs and not isinstance(kwargs["hidden_states"], DTensor):
            h = DTensor.from_local(kwargs["hidden_states"], tp_mesh, [Replicate()], run_check=False)
            return args, {**kwargs, "hidden_states": h.redistribute(tp_mesh, [Shard(1)]).to_local()}
        return None

    return hook


def apply_tp(model: nn.Module, ctx: PassContext) -> nn.Module:
    if ctx.plan.tp == 1:
        return model
    tp_mesh = ctx.mesh["tp"]
    styles = tp_styles(model, ctx)
    parallelize_module(model, tp_mesh, styles)
    for name, st in styles.items():
        ctx.record("tp", f"{name}: {type(st).__name__} over tp={ctx.plan.tp}")
    if ctx.plan.sp:
        mods = dict(model.named_modules())
        first = next((l.fqn for l in ctx.plan.layers if l.fqn in mods), None)
        if first is not None:
            mods[first].register_forward_pre_hook(_shard_sequence_hook(tp_mesh), with_kwargs=True)
            ctx.record("tp", f"{first}: residual stream split along the sequence (SP) at its input")
    return model
