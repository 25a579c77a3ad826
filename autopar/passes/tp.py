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
from autopar.passes.pp import is_real_block


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
        rules = by_scope.get(type(block).__name__, [])
        gathered = [r.module + "." for r in rules if r.style == "tp_input"]
        for rule in rules:
            if rule.style == "colwise" and any(rule.module.startswith(g) for g in gathered):
                st = ColwiseParallel(input_layouts=Replicate())  # its parent gathered the input
            else:
                st = style(rule)
            if st is not None:
                styles[f"{layer.fqn}.{rule.module}"] = st
    for rule in by_scope.get("outside", []):
        st = style(rule)
        if st is not None and rule.module in mods and is_real_block(mods[rule.module]):
            styles[rule.module] = st
    for name in styles:
        m = mods[name]
        if isinstance(styles[name], (ColwiseParallel, RowwiseParallel)) and not isinstance(m, (nn.Linear, nn.Embedding)):
            raise AutoparError(f"TP style for {name} needs nn.Linear or nn.Embedding, found {type(m).__name__}")
    return styles


def _first_tensor(args, kwargs, fn):
    """Apply ``fn`` to a module's hidden-state input: its first positional tensor, or the
    ``hidden_states`` keyword (HuggingFace passes it by name)."""
    if args and isinstance(args[0], torch.Tensor):
        return (fn(args[0]), *args[1:]), kwargs
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}
    return None


def _gather_input_hook(tp_mesh, sp: bool):
    """Forward pre-hook on a group's parent module: its input becomes a replicated DTensor once,
    so its column linears need no collective each; their input gradients (partial sums) add up
    in DTensor form and reduce once at this boundary in backward."""

    def to_replicated(x):
        if isinstance(x, DTensor):  # e.g. a SequenceParallel norm's output, Shard(1)
            return x.redistribute(tp_mesh, [Replicate()])
        if sp:
            return DTensor.from_local(x, tp_mesh, [Shard(1)], run_check=False).redistribute(tp_mesh, [Replicate()])
        return DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False)

    def hook(module, args, kwargs):
        return _first_tensor(args, kwargs, to_replicated)

    return hook


def _shard_sequence_hook(tp_mesh):
    """Forward pre-hook: the block's hidden-state input (first tensor argument) goes from whole to
    split along the sequence (dim 1). Through DTensor, so backward all-gathers its gradient."""

    def split(x):
        if isinstance(x, DTensor):
            return x.redistribute(tp_mesh, [Shard(1)]).to_local()
        return DTensor.from_local(x, tp_mesh, [Replicate()], run_check=False).redistribute(tp_mesh, [Shard(1)]).to_local()

    def hook(module, args, kwargs):
        return _first_tensor(args, kwargs, split)

    return hook


def apply_tp(model: nn.Module, ctx: PassContext) -> nn.Module:
    if ctx.plan.tp == 1:
        return model
    tp_mesh = ctx.mesh["tp"]
    styles = tp_styles(model, ctx)
    parallelize_module(model, tp_mesh, styles)
    for name, st in styles.items():
        ctx.record("tp", f"{name}: {type(st).__name__} over tp={ctx.plan.tp}")
    mods = dict(model.named_modules())
    by_cls = {}
    for r in ctx.plan.shard_rules:
        if r.style == "tp_input":
            by_cls.setdefault(r.scope, []).append(r.module)
    for layer in ctx.plan.layers:
        block = mods.get(layer.fqn)
        for sub in by_cls.get(type(block).__name__, []) if block is not None else []:
            mods[f"{layer.fqn}.{sub}"].register_forward_pre_hook(_gather_input_hook(tp_mesh, ctx.plan.sp), with_kwargs=True)
            ctx.record("tp", f"{layer.fqn}.{sub}: input " + ("all-gathered" if ctx.plan.sp else "replicated") + " once for its column linears")
    if ctx.plan.sp:
        first = ctx.plan.layers[0].fqn if ctx.plan.layers[0].fqn in mods else None
        first = first if first is not None and is_real_block(mods[first]) else None  # stage 0 only
        if first is not None:
            mods[first].register_forward_pre_hook(_shard_sequence_hook(tp_mesh), with_kwargs=True)
            ctx.record("tp", f"{first}: residual stream split along the sequence (SP) at its input")
    return model
