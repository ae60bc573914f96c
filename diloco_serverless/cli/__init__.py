"""``diloco``: the command line (the only place typer and rich are used).

:mod:`.app` holds the commands; :mod:`.render` turns a run's status into tables and lines.
"""

from __future__ import annotations

from diloco_serverless.cli.app import app, main

__all__ = ["app", "main"]
