"""Cost models: hardware profiles, collectives, roofline compute, and whole-step time/memory."""

from autopar.cost_models.hardware import Hardware, load as load_hardware
from autopar.cost_models.step import Assignment, Config, CostContext, Estimate, StageModel, estimate

__all__ = ["Hardware", "load_hardware", "Assignment", "Config", "CostContext", "Estimate", "StageModel", "estimate"]
