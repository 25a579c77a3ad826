"""Cost models: hardware profiles, collectives, roofline compute, and whole-step time/memory.

The names below load on first use, so that reading a hardware profile (``hardware.py``: the CLI
checks ``--hardware`` before anything else) does not import the step model and torch."""

_FROM = {"Hardware": "hardware", "load_hardware": "hardware", "Assignment": "step", "Config": "step",
         "CostContext": "step", "Estimate": "step", "StageModel": "step", "estimate": "step"}

__all__ = list(_FROM)


def __getattr__(name: str):
    if name not in _FROM:
        raise AttributeError(f"module 'autopar.cost_models' has no attribute {name!r}")
    import importlib

    module = importlib.import_module(f"autopar.cost_models.{_FROM[name]}")
    return getattr(module, "load" if name == "load_hardware" else name)
