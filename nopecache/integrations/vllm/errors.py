"""The vLLM connector's errors: start-up refusals, each naming what it refuses.

All four stop the engine at start-up (or, for blend mode, turn it off with the reason
logged); none is raised while serving, where a failure is a miss or a load error that
vLLM recomputes. They live in one module so that ``compat`` (which raises two of them)
and the modules that define the rules (``config``, ``layout``, ``blend_loop``, which
re-export them) import them without importing each other.
"""

from __future__ import annotations

from nopecache.client.errors import NopecacheError

__all__ = [
    "BlendUnavailableError",
    "ConnectorConfigError",
    "UnsupportedEngineError",
    "UnsupportedLayoutError",
]

_EXTRA = "kv_connector_extra_config"


class ConnectorConfigError(NopecacheError, ValueError):
    """A ``kv_connector_extra_config`` entry is missing, unknown or has a bad value."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"{_EXTRA}[{key!r}]: {reason}")
        self.key = key
        self.reason = reason

    def __reduce__(self) -> tuple[type[ConnectorConfigError], tuple[str, str]]:
        return (type(self), (self.key, self.reason))


class UnsupportedEngineError(NopecacheError, TypeError):
    """The engine's model, parallelism or KV cache is one the connector cannot serve."""


class UnsupportedLayoutError(NopecacheError, TypeError):
    """A layer's KV cache tensor matches no layout the connector knows."""


class BlendUnavailableError(RuntimeError):
    """The served model cannot be driven by the layer loop (the reason is the message)."""
