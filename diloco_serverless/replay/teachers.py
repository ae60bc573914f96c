"""Teachers: OpenAI-compatible chat-completions endpoints, their prices and limits.

A teacher file is TOML (or JSON) with one ``[[teacher]]`` table per teacher (docs/data.md,
"Teacher replay")::

    [[teacher]]
    name = "sonnet"                           # unique; names the teacher in records and tables
    model = "anthropic/claude-sonnet-4.5"     # the endpoint's model id
    base_url = "https://openrouter.ai/api/v1" # default; any OpenAI-compatible endpoint
    api_key_env = "OPENROUTER_API_KEY"        # default; the key is read from this variable, never stored
    usd_per_m_input = 3.0                     # prices per million tokens: the budget's worst case
    usd_per_m_output = 15.0
    max_tokens = 1024                         # answer cap sent with each request (the worst case)

Optional: ``temperature`` (0.0), ``timeout_s`` (120), ``max_retries`` (4), ``retry_backoff_s`` (0.5),
``reported_cost``
(true: settle a call at the cost the provider reports in ``usage.cost``, as OpenRouter does, when
it reports one), ``extra_body`` (more request fields, e.g. ``{provider = {sort = "price"}}``).

Nothing sends data anywhere unless the user names the teachers: :data:`PRESETS` are only used when
named (``--teachers openrouter-frontier``).
"""

from __future__ import annotations

import json
import math
import os
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from diloco_serverless.replay.errors import ReplayInputError

__all__ = ["PRESETS", "Teacher", "load_teachers", "prompt_token_bound", "teachers_from_data"]

OPENROUTER_URL = "https://openrouter.ai/api/v1"
_KEY_FIELDS = frozenset({"api_key", "key", "token", "api_token", "authorization", "secret", "password"})
#: tokens a chat template adds around one message, at most (role markers, separators)
TEMPLATE_TOKENS_PER_MESSAGE = 8


class Teacher(BaseModel):
    """One teacher endpoint; prices are upper bounds the budget reserves against."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, description="Unique name of the teacher in records and tables.")
    model: str = Field(min_length=1, description="The endpoint's model id.")
    base_url: str = Field(OPENROUTER_URL, description="OpenAI-compatible API root (…/v1).")
    api_key_env: str | None = Field(
        "OPENROUTER_API_KEY", description="Environment variable holding the API key; null/\"\" sends none.")
    usd_per_m_input: float = Field(ge=0, description="USD per million prompt tokens (an upper bound).")
    usd_per_m_output: float = Field(ge=0, description="USD per million completion tokens (an upper bound).")
    max_tokens: int = Field(1024, ge=1, le=1_000_000, description="Completion cap sent with each request.")
    temperature: float = Field(0.0, ge=0, le=2)
    timeout_s: float = Field(120.0, gt=0, description="Per-attempt timeout.")
    max_retries: int = Field(4, ge=0, le=20, description="Retries after 429, 5xx, timeouts, dropped connections.")
    retry_backoff_s: float = Field(
        0.5, ge=0, le=60, description="Backoff base: retry n waits uniform(0, base x 2^n) s, at most 30 s, or "
        "the server's Retry-After when longer.")
    reported_cost: bool = Field(True, description="Settle at the provider's usage.cost when it reports one.")
    extra_body: dict[str, Any] = Field(default_factory=dict, description="More request fields.")

    @model_validator(mode="before")
    @classmethod
    def _no_keys(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            keys = sorted(k for k in data if str(k).lower() in _KEY_FIELDS)
            if keys:
                raise ValueError(f"{keys[0]!r}: never put API keys in the teacher file; export the key and name its "
                                 "environment variable with api_key_env")
        return data

    @field_validator("base_url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError("must be an http(s) URL of an OpenAI-compatible API, e.g. https://openrouter.ai/api/v1")
        return v.rstrip("/")

    @field_validator("extra_body")
    @classmethod
    def _no_overrides(cls, v: dict[str, Any]) -> dict[str, Any]:
        taken = sorted(set(v) & {"model", "messages", "tools", "max_tokens", "temperature", "stream", "n"})
        if taken:
            raise ValueError(f"may not set {', '.join(taken)}: they are teacher fields, come from the trace, or "
                             "would change the answer's shape (one non-streamed choice)")
        return v

    @property
    def usd_per_input_token(self) -> float:
        return self.usd_per_m_input / 1e6

    @property
    def usd_per_output_token(self) -> float:
        return self.usd_per_m_output / 1e6

    def api_key(self) -> str | None:
        """The key from the environment (None for endpoints that need none); ReplayInputError naming the
        variable when it is unset. The key is never stored, logged or written anywhere."""
        if not self.api_key_env:
            return None
        key = os.environ.get(self.api_key_env, "")
        if not key.strip():
            raise ReplayInputError(
                f"teacher {self.name!r} reads its API key from ${self.api_key_env}, which is not set; export it "
                "(never put keys in the teacher file)")
        return key.strip()

    def worst_case_usd(self, prompt_tokens: int) -> float:
        """The most one call can cost: ``prompt_tokens`` (an upper bound) and ``max_tokens`` out."""
        return prompt_tokens * self.usd_per_input_token + self.max_tokens * self.usd_per_output_token

    def cost_usd(self, prompt_tokens: int, completion_tokens: int) -> float:
        return prompt_tokens * self.usd_per_input_token + completion_tokens * self.usd_per_output_token


def prompt_token_bound(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] = ()) -> int:
    """An upper bound on a request's prompt tokens: its UTF-8 bytes (a byte-level BPE token covers at
    least one byte) plus :data:`TEMPLATE_TOKENS_PER_MESSAGE` per message for the chat template."""
    body = json.dumps([list(messages), list(tools)], ensure_ascii=False, separators=(",", ":"))
    return len(body.encode("utf-8")) + TEMPLATE_TOKENS_PER_MESSAGE * (len(messages) + 1)


#: Named teacher sets, used only when named. Prices are upper bounds per million tokens (list prices
#: when written); OpenRouter reports each call's actual cost, which is what the budget settles at.
PRESETS: dict[str, list[dict[str, Any]]] = {
    "openrouter-frontier": [
        {"name": "claude-sonnet", "model": "anthropic/claude-sonnet-4.5", "usd_per_m_input": 3.0,
         "usd_per_m_output": 15.0},
        {"name": "gpt", "model": "openai/gpt-5", "usd_per_m_input": 1.25, "usd_per_m_output": 10.0},
        {"name": "gemini-pro", "model": "google/gemini-2.5-pro", "usd_per_m_input": 2.5,
         "usd_per_m_output": 15.0},
    ],
}


def _one_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"])
    return f"{where}: {err['msg']}"


def teachers_from_data(rows: Any, where: str) -> list[Teacher]:
    """Teachers from decoded rows (a list of tables); ReplayInputError naming the teacher and field."""
    if not isinstance(rows, list) or not rows:
        raise ReplayInputError(f"{where}: no teachers; add one [[teacher]] table per teacher (docs/data.md)")
    out: list[Teacher] = []
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise ReplayInputError(f"{where}: teacher {i} must be a table, got {type(row).__name__}")
        try:
            out.append(Teacher.model_validate(dict(row)))
        except ValidationError as exc:
            label = row.get("name", i)
            raise ReplayInputError(f"{where}: teacher {label!r}: {_one_error(exc)}") from None
    names = [t.name for t in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ReplayInputError(f"{where}: teacher names must be unique; {', '.join(dup)} appear twice")
    return out


def load_teachers(file_or_preset: str) -> list[Teacher]:
    """The teachers of a TOML/JSON teacher file, or of a preset named in :data:`PRESETS`."""
    if file_or_preset in PRESETS:
        return teachers_from_data(PRESETS[file_or_preset], f"preset {file_or_preset!r}")
    p = Path(file_or_preset)
    if not p.is_file():
        raise ReplayInputError(
            f"--teachers {file_or_preset!r} is neither a teacher file nor a preset ({', '.join(sorted(PRESETS))}); "
            "write a TOML file with one [[teacher]] table each (docs/data.md, 'Teacher replay')")
    text = p.read_text("utf-8")
    try:
        data = json.loads(text) if p.suffix == ".json" else tomllib.loads(text)
    except ValueError as exc:
        raise ReplayInputError(f"{p}: not valid {'JSON' if p.suffix == '.json' else 'TOML'}: {exc}") from None
    rows = data.get("teacher", data.get("teachers")) if isinstance(data, Mapping) else data
    return teachers_from_data(rows, str(p))


def check_prices(teachers: Sequence[Teacher]) -> None:
    """Every teacher needs finite prices (the budget's worst case)."""
    for t in teachers:
        if not (math.isfinite(t.usd_per_m_input) and math.isfinite(t.usd_per_m_output)):
            raise ReplayInputError(f"teacher {t.name!r}: prices must be finite numbers")
