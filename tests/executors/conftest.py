"""Executor tests: the ``sdk`` marker (vendor SDK floors, offline; ``pytest -m sdk`` runs them alone)."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "sdk: the installed vendor SDKs (modal, huggingface_hub) against the floors in pyproject.toml")
