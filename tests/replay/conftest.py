"""Fixtures of the replay tests: a teacher API key in the environment, teachers on a fake server."""

from __future__ import annotations

import pytest

from diloco_serverless.replay.teachers import Teacher

KEY_ENV = "DILOCO_TEST_TEACHER_KEY"
SECRET = "sk-test-7f3a9c-NEVER-STORE-ME"


@pytest.fixture
def api_key(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(KEY_ENV, SECRET)
    return SECRET


def teacher(name: str, url: str, **kw: object) -> Teacher:
    """A teacher on the fake server: model id = name, cheap prices, short timeouts and retries."""
    base: dict[str, object] = {"name": name, "model": name, "base_url": url, "api_key_env": KEY_ENV,
                               "usd_per_m_input": 1.0, "usd_per_m_output": 2.0, "max_tokens": 64,
                               "timeout_s": 5.0, "max_retries": 3}
    base.update(kw)
    return Teacher.model_validate(base)
