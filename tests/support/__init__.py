"""Helpers shared by the tests: paths, fake executors and servers, replica harnesses.

``tests/`` is on ``sys.path`` (pyproject's ``pythonpath``), so tests import ``support.<module>``;
subprocesses that must import the same modules get :func:`pythonpath_env`.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import ModuleType

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


def import_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` imported by name from its folder (as its own imports and the replica
    processes it starts expect), checked to be this repository's file."""
    import importlib

    folder = str(REPO_ROOT / "benchmarks")
    if folder not in sys.path:
        sys.path.insert(0, folder)
    module = importlib.import_module(name)
    assert module.__file__ == str(REPO_ROOT / "benchmarks" / f"{name}.py"), module.__file__
    return module
