"""The engines' own errors (a module of its own, so that every engine module can raise them): an engine that
cannot run here (the CLI: exit 2, the message names the fix) and one that started and failed."""
from __future__ import annotations


class EngineUnavailable(RuntimeError):
    """The engine asked for cannot run here (no vLLM venv, no server listening); the message says why and how to
    get one (the CLI: exit 2)."""


class EngineFailed(RuntimeError):
    """An engine process that started ended with an error; the message holds its log's last lines."""
