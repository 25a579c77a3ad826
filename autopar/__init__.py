"""autopar: automatic parallelism for PyTorch training.

``autopar.plan(model, gpus, ...)`` traces a model on fake tensors, prices tensor, sequence,
pipeline and data parallelism (FSDP) with activation checkpointing on a hardware profile, and
returns the fastest ``Plan`` that fits in memory.
"""

__version__ = "0.1.0"

from autopar.api import compile, estimate_plan, plan, profile_model  # noqa: E402,A004
from autopar.errors import AutoparError, InfeasibleError, PlanMismatchError, TraceError  # noqa: E402
from autopar.plan import Plan  # noqa: E402
from autopar.runtime import ParallelModule  # noqa: E402

__all__ = [
    "plan", "compile", "ParallelModule", "estimate_plan", "profile_model", "Plan", "AutoparError", "InfeasibleError",
    "PlanMismatchError", "TraceError", "__version__",
]
