"""Helpers shared by the tests: paths, fake executors and servers, replica harnesses.

``tests/`` is on ``sys.path`` (pyproject's ``pythonpath``), so tests import ``support.<module>``;
subprocesses that must import the same modules get :func:`pythonpath_env`.
"""

from __future__ import annotations

import os
from pathlib import Path

#: ``tests/``
TESTS_DIR = Path(__file__).resolve().parents[1]
#: the repository root
REPO_ROOT = TESTS_DIR.parent
#: static inputs of the tests (golden Terraform outputs)
FIXTURES = TESTS_DIR / "fixtures"
#: module of the stand-in replica (``python -m support.fake_replica``)
FAKE_REPLICA = "support.fake_replica"


def pythonpath_env() -> str:
    """A ``PYTHONPATH`` value under which a subprocess imports ``support.*`` as the tests do."""
    return os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
