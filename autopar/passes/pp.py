"""Pipeline parallelism: split the model into stage modules at the planned layer boundaries and
run them with ``torch.distributed.pipelining`` schedules (GPipe, 1F1B, interleaved 1F1B).

A stage is the original module with everything outside the stage made free, so no model-specific
forward is needed and parameter names stay the original ones:

- layers of other stages become ``PassThrough`` (no parameters, returns its hidden input);
- on every stage but the first, parameterised modules before the blocks (embeddings) become
  ``ZeroEmbedding`` stubs of the right shape, and the stage's first layer takes the activation
  received from the previous stage instead (a forward pre-hook);
- on every stage but the last, parameterised modules after the blocks (final norm, head) become
  ``Identity``, so the model's own forward returns the last layer's hidden state.

The model's own forward still runs on each stage, so whatever it derives from the input shape
(positions, masks, rotary tables) is there. Interleaved schedules build ``v`` such stages per rank
from copies of the model. Pipeline stage ``s`` holds chunk ``s // pp`` of rank ``s % pp``.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from autopar.capture import logits_of
from autopar.errors import AutoparError
from autopar.plan import Plan


class PassThrough(nn.Module):
    """A layer that runs on another pipeline stage: returns its hidden-state input."""

    def forward(self, *args, **kwargs):
        return args[0] if args else kwargs["hidden_states"]


class ZeroEmbedding(nn.Module):
    """An embedding on a later pipeline stage: zeros of the right shape, no parameters."""

    def __init__(self, dim: int, dtype: torch.dtype):
        super().__init__()
        self.dim, self.dtype = dim, dtype

    def forward(self, ids, *args, **kwargs):
        return torch.zeros(*ids.shape, self.dim, dtype=self.dtype, device=ids.device)


def _set(model: nn.Module, fqn: str, new: nn.Module) -> None:
    parent, _, name = fqn.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, new)


def is_real_block(module: nn.Module) -> bool:
    return not isinstance(module, (PassThrough, ZeroEmbedding, nn.Identity))


def build_stage(model: nn.Module, plan: Plan, stage: int) -> nn.Module:
    """Turn ``model`` (in place) into pipeline stage ``stage`` of ``plan.pp * plan.v``."""
    n_stages = plan.pp * plan.v
    mine = [l.fqn for l in plan.layers if l.chunk * plan.pp + l.stage == stage]
    if not mine:
        raise AutoparError(f"pipeline stage {stage} of the plan has no layers")
    first, last = stage == 0, stage == n_stages - 1
    for l in plan.layers:
        if l.fqn not in mine:
            _set(model, l.fqn, PassThrough())
    for mod, segment, _ in plan.outer_modules:
        try:
            m = model.get_submodule(mod)
        except AttributeError:
            continue
        if segment == "pre" and not first:
            if not isinstance(m, nn.Embedding):
                raise AutoparError(f"cannot place {mod} ({type(m).__name__}) before the blocks on a later pipeline stage")
            _set(model, mod, ZeroEmbedding(m.embedding_dim, m.weight.dtype))
        elif segment == "post" and not last:
            _set(model, mod, nn.Identity())
    inner = model.forward
    box: dict = {}
    if not first:
        def inject(module, args, kwargs):
            x = box.pop("x")
            if args and isinstance(args[0], torch.Tensor):
                return (x, *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": x}

        model.get_submodule(mine[0]).register_forward_pre_hook(inject, with_kwargs=True)

    def forward(x):
        if first:
            return logits_of(inner(x))
        box["x"] = x
        ids = torch.zeros((x.shape[0], plan.seq_len), dtype=torch.long, device=x.device)
        return logits_of(inner(ids))

    model.forward = forward
    return model


def split_stages(model: nn.Module, plan: Plan, pp_rank: int) -> list[tuple[int, nn.Module]]:
    """The (stage index, module) pairs this pipeline rank runs, in chunk order."""
    stages = []
    for chunk in range(plan.v):
        m = model if chunk == plan.v - 1 else copy.deepcopy(model)
        stages.append((chunk * plan.pp + pp_rank, build_stage(m, plan, chunk * plan.pp + pp_rank)))
    return stages
