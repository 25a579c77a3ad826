"""Errors autopar raises. Each message says what was wrong, with the numbers, and what to do."""


class AutoparError(ValueError):
    """Base class: bad input or an impossible request."""


class TraceError(AutoparError):
    """The model could not be traced; the message names the node and its source line."""


class InfeasibleError(AutoparError):
    """No plan fits; the message gives the closest plan's shortfall and what would fit."""


class PlanMismatchError(AutoparError):
    """A saved plan was made for another model, mesh or format version."""
