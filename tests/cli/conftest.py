"""Fixtures of the CLI tests: a working directory of their own, and a fake executor behind the CLI."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.fake_executor import FakeExecutor, use_fake_executor


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeExecutor:
    """Every executor the CLI builds (for launch or from run.json) is this fake."""
    ex = FakeExecutor()
    use_fake_executor(monkeypatch, ex)
    return ex
