"""autopar: automatic parallelism for PyTorch training.

``autopar.plan(model, gpus, ...)`` traces a model on fake tensors, prices tensor, sequence,
pipeline and data parallelism (FSDP) with activation checkpointing on a hardware profile, and
returns the fastest ``Plan`` that fits in memory. ``autopar.compile(model, mesh)`` applies it.

The names below are loaded on first use, so ``import autopar`` (and ``autopar --version``)
does not pay for torch, Dynamo, the solver or rich until something needs them.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_LAZY = {
    "compile": "autopar.api", "estimate_plan": "autopar.api", "profile_model": "autopar.api",
    "ParallelModule": "autopar.runtime", "shutdown": "autopar.runtime", "Plan": "autopar.plan",
    "AutoparError": "autopar.errors", "InfeasibleError": "autopar.errors", "PlanMismatchError": "autopar.errors",
    "TraceError": "autopar.errors",
}

__all__ = [*_LAZY, "plan", "__version__"]


# ``autopar.plan`` is both a submodule (the Plan data object) and the planning function. The
# submodule is light: import it now, so that importing it later cannot rebind the name, and bind
# the function over it.
import autopar.plan as _plan_module  # noqa: E402, F401


def plan(*args, **kwargs):
    from autopar.api import plan as _plan

    return _plan(*args, **kwargs)


plan.__doc__ = "Plan ``model`` for a mesh: see :func:`autopar.api.plan`."


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'autopar' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
