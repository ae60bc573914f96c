"""The replay layer's errors, in the package's families (docs/architecture.md, "Errors")."""

from __future__ import annotations

from diloco_serverless.errors import UserInputError

__all__ = ["ReplayInputError"]


class ReplayInputError(UserInputError):
    """A trace file, teacher file or replay option is wrong; the message names it and the fix."""

