"""Every error the package raises derives from :class:`DilocoError`, in one of a few families.

Callers catch a family, not a module's private class:

* :class:`UserInputError` (a :class:`ValueError`): the input is wrong and the message says how to fix
  it (a config field, a launch option, a dataset, a model name). The CLI and the replica entrypoint
  report it as one ``error:`` line and exit with code 2.
* :class:`StoreError`: an object-store operation failed; the message names the URL and key
  (subclasses in :mod:`diloco_serverless.store.errors`).
* :class:`RunError`: a run's folder is missing, invalid or already taken
  (:mod:`diloco_serverless.run.record`).
* :class:`ExchangeError`: a round of the all-reduce could not complete
  (:mod:`diloco_serverless.exchange.errors`).
* :class:`CheckpointError`: a checkpoint is corrupt or does not fit the model
  (:mod:`diloco_serverless.trainer.checkpoint`).
* :class:`ExecutorError`: launching, polling or cancelling replicas failed
  (:mod:`diloco_serverless.executors.base`).

Each family keeps the builtin base it had before this module existed (``RuntimeError``,
``ValueError``), so ``except RuntimeError`` in user code still catches what it caught.
This module imports nothing from the package: every layer may import it (docs/architecture.md).
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DilocoError",
    "ExchangeError",
    "ExecutorError",
    "LaunchError",
    "RunError",
    "StoreError",
    "UserInputError",
    "one_line",
]


class DilocoError(Exception):
    """Base of every error raised by diloco-serverless."""


class UserInputError(DilocoError, ValueError):
    """Bad input: the message names what is wrong and what to do. Exit code 2 in the CLI and replicas."""


class ConfigError(UserInputError):
    """A config file, override or value is invalid; the message names the field and the fix."""


class LaunchError(UserInputError):
    """Bad input to launch (or to another CLI command): a one-line message with the fix."""


class StoreError(DilocoError, RuntimeError):
    """Base class: an object-store operation failed. The message names URL and key."""

    def __init__(self, message: str, *, url: str = "", key: str = "", op: str = "") -> None:
        super().__init__(message)
        self.url = url
        self.key = key
        self.op = op


class RunError(DilocoError, RuntimeError):
    """Base of run-layout errors; the message names the run URL."""


class ExchangeError(DilocoError, RuntimeError):
    """Base class: the exchange through the object store could not complete a round."""


class CheckpointError(DilocoError, RuntimeError):
    """Base class: a stored checkpoint cannot be used (corrupt, or shaped for another model)."""


class ExecutorError(DilocoError, RuntimeError):
    """Base class for executor errors; the message names the executor, rank or job involved."""


def one_line(message: str) -> str:
    """Collapse a multi-line message (e.g. a ConfigError listing fields) into one line."""
    parts = [p.strip() for p in str(message).splitlines() if p.strip()]
    if len(parts) > 1 and parts[0].endswith(":"):
        return parts[0] + " " + "; ".join(parts[1:])
    return "; ".join(parts)
