"""The engine's two start-up / run-time error types (every other bad input is a ValueError)."""


class EngineStartupError(RuntimeError):
    """A resource could not be allocated at start-up; the message names the knob to change."""


class EngineDeadError(RuntimeError):
    """An engine-wide fault (device error, a failed forward) stopped the engine."""
