"""Teacher files and presets, the budget's worst case, and Retry-After parsing."""

from __future__ import annotations

import email.utils
import json
from pathlib import Path

import pytest

from diloco_serverless.replay.client import backoff_s, parse_retry_after
from diloco_serverless.replay.errors import ReplayInputError
from diloco_serverless.replay.teachers import PRESETS, load_teachers, prompt_token_bound

TOML = """
[[teacher]]
name = "a"
model = "org/a"
usd_per_m_input = 3.0
usd_per_m_output = 15.0
max_tokens = 100

[[teacher]]
name = "local"
model = "qwen"
base_url = "http://127.0.0.1:8000/v1/"
api_key_env = ""
usd_per_m_input = 0
usd_per_m_output = 0
"""


def test_toml_and_json_files(tmp_path: Path) -> None:
    p = tmp_path / "t.toml"
    p.write_text(TOML)
    a, local = load_teachers(str(p))
    assert (a.base_url, a.api_key_env, a.max_tokens, a.reported_cost) == (
        "https://openrouter.ai/api/v1", "OPENROUTER_API_KEY", 100, True)
    assert a.worst_case_usd(1000) == pytest.approx(1000 * 3e-6 + 100 * 15e-6)
    assert local.base_url == "http://127.0.0.1:8000/v1" and local.api_key() is None
    j = tmp_path / "t.json"
    j.write_text(json.dumps({"teachers": [a.model_dump(), local.model_dump()]}))
    assert load_teachers(str(j)) == [a, local]


@pytest.mark.parametrize(("text", "message"), [
    ('[[teacher]]\nname = "a"\nmodel = "m"\nusd_per_m_input = 1\n', "teacher 'a': usd_per_m_output: Field required"),
    ('[[teacher]]\nname = "a"\nmodel = "m"\nusd_per_m_input = -1\nusd_per_m_output = 1\n', "usd_per_m_input"),
    ('[[teacher]]\nname = "a"\nmodel = "m"\nusd_per_m_input = 1\nusd_per_m_output = 1\napi_key = "sk-1"\n',
     "never put API keys in the teacher file"),
    ('[[teacher]]\nname = "a"\nmodel = "m"\nusd_per_m_input = 1\nusd_per_m_output = 1\nbase_url = "ftp://x"\n',
     "must be an http(s) URL"),
    ('[[teacher]]\nname = "a"\nmodel = "m"\nusd_per_m_input = 1\nusd_per_m_output = 1\n'
     '[[teacher]]\nname = "a"\nmodel = "n"\nusd_per_m_input = 1\nusd_per_m_output = 1\n', "a appear twice"),
    ('[[teacher]]\nname = "a"\nmodel = "m"\nusd_per_m_input = 1\nusd_per_m_output = 1\n'
     'extra_body = { model = "x" }\n', "may not set model"),
    ('[[teacher]]\nname = "a"\nmodel = "m"\nusd_per_m_input = 1\nusd_per_m_output = 1\n'
     'extra_body = { stream = true }\n', "may not set stream"),
    ("x = 1\n", "no teachers"),
    ("[[teacher]\n", "not valid TOML"),
])
def test_bad_teacher_files(tmp_path: Path, text: str, message: str) -> None:
    p = tmp_path / "t.toml"
    p.write_text(text)
    with pytest.raises(ReplayInputError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        load_teachers(str(p))
    assert "sk-1" not in str(err.value)


def test_presets_only_when_named() -> None:
    assert [t.name for t in load_teachers("openrouter-frontier")] == [t["name"] for t in PRESETS["openrouter-frontier"]]
    with pytest.raises(ReplayInputError, match="neither a teacher file nor a preset"):
        load_teachers("openrouter")


def test_prompt_bound_covers_utf8_bytes() -> None:
    msgs = [{"role": "user", "content": "héllo wörld " * 10}]
    assert prompt_token_bound(msgs) >= len(json.dumps(msgs, ensure_ascii=False).encode()) + 8


def test_retry_after() -> None:
    assert parse_retry_after("3") == 3.0 and parse_retry_after("0.5") == 0.5
    assert parse_retry_after(None) is None and parse_retry_after("soon") is None and parse_retry_after("-4") == 0
    assert parse_retry_after("nan") is None
    date = email.utils.formatdate(1_000_010, usegmt=True)
    assert parse_retry_after(date, now=1_000_000) == pytest.approx(10.0)
    import random

    rng = random.Random(0)
    assert backoff_s(0, 2.0, rng) == 2.0  # Retry-After longer than the jitter wins
    assert all(0 <= backoff_s(3, None, rng) <= 4.0 for _ in range(50))  # uniform(0, 0.5 x 2^3)
