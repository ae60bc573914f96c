"""RunConfig: everything a run needs, validated once, stored in ``run.json``.

A run is described by one :class:`RunConfig` (pydantic v2, ``extra="forbid"``), loaded from a
TOML file and ``--set section.key=value`` overrides::

    cfg = RunConfig.load("examples/tiny.toml", ["inner.lr=3e-4", "replicas=8"])
    cfg = cfg.with_overrides(["rounds=20"])   # same --set syntax on top of an existing object
    store_json = cfg.to_json_dict()          # what goes into <run>/run.json

The defaults are the DiLoCo paper's (arXiv 2311.08105: outer Nesterov SGD, lr 0.7, momentum 0.9)
sized so that ``diloco launch`` (4 local replicas, the tiny model, the stdlib corpus, a file store
under ``./runs``) finishes in a few minutes on 2 CPU cores with all three ``compose_loss`` channels
live. See docs/config.md for the reference of every field.

Failure: any invalid value raises :class:`ConfigError` (a ``ValueError``) whose message names the
dotted field, the offending value, what is allowed, and where the value came from (file or
``--set``). Storage credentials are never fields: they come from the environment (see
``diloco_serverless.store``); a value that looks like a secret is refused.
"""

from __future__ import annotations

import difflib
import re
import secrets as _secrets
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal, cast, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from diloco_serverless.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

__all__ = [
    "ConfigError",
    "ModelConfig",
    "DataConfig",
    "MIN_RESPONSE_TOKENS",
    "InnerConfig",
    "OuterConfig",
    "LossConfig",
    "ExchangeConfig",
    "RunConfig",
    "generate_run_id",
    "find_secret",
    "RUN_ID_PATTERN",
    "ROUND_TIMEOUT_S",
    "STRAGGLER_TIMEOUT_S",
    "TAKEOVER_TIMEOUT_S",
    "POLL_INTERVAL_S",
    "tomllib",
    "Codec",
    "TRUST_REMOTE_CODE_ENV",
    "RUN_KEY_ENV",
]

RUN_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


def generate_run_id() -> str:
    """A fresh, sortable run id such as ``run-20261129-214455-ab12`` (UTC time + 4 random hex)."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    return f"run-{stamp}-{_secrets.token_hex(2)}"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    """Which model to train (``diloco_serverless.trainer.model.build_model``)."""

    name: str = Field(
        "tiny",
        description='"tiny" (a ~1M-parameter Qwen2 with a byte-level tokenizer, random init, nothing '
        "downloaded) or a Hugging Face model name / local directory loaded with AutoModelForCausalLM.",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Parameter dtype of the model replicas train. Outer state and reduction stay fp32."
    )
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) of a named model.")
    trust_remote_code: bool = Field(
        False, description="Passed to from_pretrained for named models; leave off unless you trust the repo."
    )

    @field_validator("name")
    @classmethod
    def _name_not_empty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError('must be "tiny" or a Hugging Face model name, not empty')
        return v


MIN_RESPONSE_TOKENS = 8
"""Least ``data.seq_len - data.prompt_len``: the stdlib builder needs >= 2 response tokens (two pieces
to shuffle into the rejected answer); 8 keeps the examples meaningful."""


class DataConfig(_Section):
    """Training data and batching (``diloco_serverless.data``)."""

    source: str = Field(
        "stdlib",
        description='"stdlib" (the Python standard library\'s own .py files) or a JSONL file: a local path or '
        "any fsspec URL (s3://, gs://, ...) of records {prompt, response, hint?, chosen?, rejected?}.",
    )
    seq_len: int = Field(128, ge=16, le=32768, description="Tokens per student sequence (prompt + response).")
    batch_size: int = Field(8, ge=1, description="Sequences per inner step per replica.")
    prompt_len: int = Field(
        32, ge=1, description="stdlib corpus: max tokens of preceding code used as the prompt (<= seq_len - 8)."
    )
    hint_len: int = Field(
        64,
        ge=0,
        description="Max tokens of the hint (file path + module docstring) the self-distillation teacher sees.",
    )
    eval_fraction: float = Field(
        0.05, gt=0.0, lt=1.0, description="stdlib / JSONL: share of files (records) held out for eval, by path hash."
    )
    eval_batches: int = Field(4, ge=1, description="Batches of the held-out split per evaluation.")

    @model_validator(mode="after")
    def _room_for_a_response(self) -> DataConfig:
        """The stdlib response budget is ``seq_len - prompt_len`` tokens; below
        ``MIN_RESPONSE_TOKENS`` the examples would be a few tokens (or impossible: < 2)."""
        if self.seq_len - self.prompt_len < MIN_RESPONSE_TOKENS:
            raise ValueError(
                f"data.prompt_len ({self.prompt_len}) must be smaller than data.seq_len ({self.seq_len}) by at "
                f"least {MIN_RESPONSE_TOKENS} tokens (the response budget seq_len - prompt_len is "
                f"{self.seq_len - self.prompt_len}); set data.prompt_len <= {self.seq_len - MIN_RESPONSE_TOKENS} "
                f"or data.seq_len >= {self.prompt_len + MIN_RESPONSE_TOKENS}"
            )
        return self


class InnerConfig(_Section):
    """The inner optimizer (AdamW) every replica runs for ``sync_every`` steps between syncs."""

    lr: float = Field(3e-3, gt=0.0, le=1.0, description="AdamW peak learning rate.")
    warmup_steps: int = Field(20, ge=0, description="Linear warmup of the inner lr, in inner steps.")
    weight_decay: float = Field(0.1, ge=0.0, description="AdamW decoupled weight decay.")
    grad_clip: float = Field(1.0, ge=0.0, description="Max global grad norm per inner step; 0 disables clipping.")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW (beta1, beta2).")
    sync_every: int = Field(16, ge=1, description="H: inner steps per round (between outer syncs of the whole model).")

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"both betas must lie in [0, 1), got {list(v)}")
        return v


class OuterConfig(_Section):
    """The outer optimizer applied to the averaged pseudo-gradient (DiLoCo: Nesterov SGD)."""

    lr: float = Field(0.7, gt=0.0, le=10.0, description="Outer SGD learning rate (DiLoCo default 0.7).")
    momentum: float = Field(0.9, ge=0.0, lt=1.0, description="Outer SGD momentum (DiLoCo default 0.9).")
    nesterov: bool = Field(True, description="Nesterov momentum (DiLoCo default true).")

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> OuterConfig:
        if self.nesterov and self.momentum == 0.0:
            raise ValueError("outer.nesterov=true needs outer.momentum > 0; set a momentum or nesterov=false")
        return self


class LossConfig(_Section):
    """Weights and variants of ``compose_loss`` (total = lm_ce + alpha_sdpo*sdpo_jsd + beta_replay*dpo)."""

    alpha_sdpo: float = Field(0.5, ge=0.0, description="Weight of channel 2 (hint self-distillation); 0 disables it.")
    beta_replay: float = Field(0.1, ge=0.0, description="Weight of channel 3 (trace-replay preference); 0 disables it.")
    dpo_variant: Literal["dpo", "simpo"] = Field(
        "dpo", description='"dpo" (needs reference log-probs from a frozen initial model) or "simpo" (no reference).'
    )
    dpo_beta: float = Field(0.1, gt=0.0, description="DPO inverse temperature.")
    simpo_beta: float = Field(2.0, gt=0.0, description="SimPO reward scale.")
    simpo_gamma: float = Field(1.0, ge=0.0, description="SimPO target reward margin.")
    jsd_beta: float = Field(
        0.5, ge=0.0, le=1.0, description="Generalized JSD interpolation: 0 forward KL, 1 reverse KL (as TRL GKD)."
    )
    sdpo_wrapper: Literal["none", "taid", "entropy_opd"] = Field(
        "none", description='Wrapper of channel 2: "none" (JSD), "taid" (arXiv 2501.16937) or "entropy_opd".'
    )
    taid_t_start: float = Field(0.4, ge=0.0, le=1.0, description="TAID: initial interpolation t.")
    taid_t_end: float = Field(1.0, ge=0.0, le=1.0, description="TAID: final interpolation t.")
    taid_alpha: float = Field(5e-4, ge=0.0, description="TAID: adaptive schedule step size.")
    taid_beta: float = Field(0.99, ge=0.0, lt=1.0, description="TAID: adaptive schedule momentum.")
    taid_disable_adaptive: bool = Field(False, description="TAID: use the linear schedule instead of the adaptive one.")
    entropy_opd_h_max: float | None = Field(
        None, gt=0.0, description="Entropy-aware OPD: entropy that maps to full forward KL; unset means log(V)."
    )

    @model_validator(mode="after")
    def _taid_range(self) -> LossConfig:
        if self.taid_t_end < self.taid_t_start:
            raise ValueError(f"loss.taid_t_end ({self.taid_t_end}) must be >= loss.taid_t_start ({self.taid_t_start})")
        return self

    def compose_kwargs(self, taid_t: float | None = None) -> dict[str, Any]:
        """Keyword arguments for ``compose_loss``; ``taid_t`` comes from a TAIDScheduler when wrapper is taid."""
        return {
            "alpha_sdpo": self.alpha_sdpo,
            "beta_replay": self.beta_replay,
            "dpo_variant": self.dpo_variant,
            "dpo_beta": self.dpo_beta,
            "simpo_beta": self.simpo_beta,
            "simpo_gamma": self.simpo_gamma,
            "jsd_beta": self.jsd_beta,
            "sdpo_wrapper": self.sdpo_wrapper,
            "taid_t": taid_t if self.sdpo_wrapper == "taid" else None,
            "entropy_opd_h_max": self.entropy_opd_h_max,
        }

    @property
    def needs_reference(self) -> bool:
        """True when batches must carry reference log-probs (DPO with the replay channel on)."""
        return self.beta_replay > 0.0 and self.dpo_variant == "dpo"


#: Set to "1" by the launcher in every replica's environment when it was given --trust-remote-code;
#: replicas honour model.trust_remote_code only then, never from the stored config alone.
TRUST_REMOTE_CODE_ENV = "DILOCO_TRUST_REMOTE_CODE"
#: The environment variable that carries the run key to replicas (diloco_serverless.run.integrity).
#: Its name marks it a secret, so the executors never send it as plain configuration.
RUN_KEY_ENV = "DILOCO_RUN_KEY"

#: Pseudo-gradient codecs on the wire (implemented in diloco_serverless.exchange.codec).
Codec = Literal["fp32", "bf16", "int8"]

#: Exchange deadlines and polling, in seconds: the one definition of their defaults, used by
#: ExchangeConfig, ObjectStoreAllReduce and ObjectStoreManager alike.
ROUND_TIMEOUT_S = 1800.0
STRAGGLER_TIMEOUT_S = 60.0
TAKEOVER_TIMEOUT_S = 60.0
POLL_INTERVAL_S = 0.5


class ExchangeConfig(_Section):
    """How pseudo-gradients travel through the store (``ObjectStoreAllReduce``)."""

    codec: Codec = Field("fp32", description="Pseudo-gradient codec on the wire.")
    error_feedback: bool = Field(False, description="Add the codec's residual to the next round (lossy codecs).")
    fragments: int = Field(1, ge=1, description="Streaming DiLoCo fragments; must divide inner.sync_every.")
    fragment_sync_delay: int = Field(
        0, ge=0, description="Inner steps a fragment's exchange overlaps with training (Streaming DiLoCo tau)."
    )
    straggler_timeout_s: float = Field(
        STRAGGLER_TIMEOUT_S,
        gt=0.0,
        description="After the first ready marker, wait this long for the rest before a partial quorum.",
    )
    round_timeout_s: float = Field(
        ROUND_TIMEOUT_S, gt=0.0, description="Give up on a round (TimeoutError) after this long."
    )
    takeover_timeout_s: float = Field(
        TAKEOVER_TIMEOUT_S, gt=0.0, description="Reduce a dead owner's shard from stored contributions after this long."
    )
    poll_interval_s: float | None = Field(
        None, gt=0.0, description="Seconds between store polls while waiting; unset uses the exchange's default."
    )
    keep_rounds: int | None = Field(
        4, ge=1, description="Keep this many recent rounds' objects in the store (healing); unset keeps all."
    )


#: A 40-character AWS secret access key: base64 characters mixing upper case, lower case and
#: digits, with at most two "/" (a path has more), standing alone (the whole value, or set off by
#: characters outside base64 such as "=", ":", "&", "." or a space; inside a longer path it is not
#: told from the path). A 40-hex digest (a sha1, a git commit as ``model.revision``) is never
#: matched: hex has no mix of upper and lower case. An ordinary 40-character value of letters and
#: digits in mixed case (a long run id) is refused too; rename it.
_AWS_SECRET_KEY = (
    r"(?<![A-Za-z0-9/+])"
    r"(?=[A-Za-z0-9/+]{0,39}[A-Z])(?=[A-Za-z0-9/+]{0,39}[a-z])(?=[A-Za-z0-9/+]{0,39}[0-9])"
    r"(?!(?:[A-Za-z0-9+]*/){3})"
    r"[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+=])"
)

#: (kind, pattern): what :func:`find_secret` recognises, first match wins. Errors name the kind, never
#: the value.
_SECRET_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("an AWS access key id", re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b")),
    ("a Hugging Face token", re.compile(r"\bhf_[A-Za-z0-9]{30,}\b")),
    ("a GitHub token", re.compile(r"\b(gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{22,})\b")),
    ("an API key", re.compile(r"\bsk-[A-Za-z0-9_-]{20,}\b")),
    ("a Modal token", re.compile(r"\b(ak|as)-[A-Za-z0-9]{20,}\b")),
    ("a JSON Web Token", re.compile(r"\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*")),
    ("a private key", re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----")),
    ("a password in a URL", re.compile(r"\b[a-z][a-z0-9+.-]*://[^/@\s]*:[^/@\s]+@", re.I)),
    ("a signed URL credential", re.compile(
        r"\b(X-Amz-Signature|X-Amz-Credential|X-Amz-Security-Token|X-Goog-Signature|X-Goog-Credential)=", re.I)),
    ("an S3 SigV2 signed URL", re.compile(r"[?&](Signature|AWSAccessKeyId)=", re.I)),
    ("a URL query credential", re.compile(r"[?&](sig|token|access_token)=", re.I)),
    # last: the least specific pattern, so a prefixed token is named by its own kind
    ("an AWS secret access key", re.compile(_AWS_SECRET_KEY)),
)


def find_secret(value: str) -> str | None:
    """Name of the secret kind ``value`` looks like (e.g. "a Hugging Face token"), or None.

    The name is safe to print; the value never is.
    """
    for kind, pattern in _SECRET_PATTERNS:
        if pattern.search(value):
            return kind
    return None


def _quote(value: Any, limit: int = 80) -> str:
    """``repr(value)`` for an error message, or ``<a value that looks like KIND>`` when it holds a secret.

    Long values are cut to ``limit`` characters, so an error stays one readable line.
    """
    text = value if isinstance(value, str) else repr(value)
    kind = find_secret(text)
    if kind is not None:
        return f"<a value that looks like {kind}, not shown>"
    quoted = repr(value)
    return quoted if len(quoted) <= limit else quoted[: limit - 3] + "..."


def _quote_override(item: str) -> str:
    """An override as an error shows it: ``key=value``, or ``key=<... KIND, not shown>`` around a secret."""
    if find_secret(item) is None:
        return item
    key, sep, value = item.partition("=")
    if sep and find_secret(key) is None and find_secret(value) is not None:
        return f"{key.strip()}={_quote(value)}"
    return _quote(item)


class RunConfig(_Section):
    """One training run. Written to ``<store>/<run_id>/run.json`` and read by every replica."""

    run_id: str = Field(
        default_factory=generate_run_id,
        pattern=RUN_ID_PATTERN,
        description="Run name, the folder under the store; default run-<UTC date>-<time>-<4 hex>.",
    )
    store: str = Field(
        "./runs",
        description="Store URL runs live under: a local path, file://, memory://, s3://bucket/prefix, gs://...",
    )
    replicas: int = Field(4, ge=1, le=4096, description="N: replicas launched (the exchange's world size).")
    min_replicas: int | None = Field(
        None, ge=1, description="Smallest quorum a round may close with after the straggler timeout; unset = replicas."
    )
    rounds: int = Field(10, ge=1, description="Outer rounds (each = inner.sync_every inner steps + one sync).")
    checkpoint_every: int = Field(5, ge=0, description="Global checkpoint every this many rounds; 0 = only at the end.")
    eval_every: int = Field(
        5, ge=0, description="Rank 0 evaluates on the held-out split every this many rounds; 0 = end only."
    )
    seed: int = Field(0, ge=0, description="Seed of model init, data order and shuffles (plus rank where per-replica).")
    model: ModelConfig = Field(default_factory=ModelConfig, description="[model] section.")
    data: DataConfig = Field(default_factory=DataConfig, description="[data] section.")
    inner: InnerConfig = Field(default_factory=InnerConfig, description="[inner] section.")
    outer: OuterConfig = Field(default_factory=OuterConfig, description="[outer] section.")
    loss: LossConfig = Field(default_factory=LossConfig, description="[loss] section.")
    exchange: ExchangeConfig = Field(default_factory=ExchangeConfig, description="[exchange] section.")

    @field_validator("store")
    @classmethod
    def _store_not_empty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must be a path or URL such as ./runs or s3://bucket/prefix")
        return v.rstrip("/") or v

    @model_validator(mode="after")
    def _cross_field_checks(self) -> RunConfig:
        if self.min_replicas is not None and self.min_replicas > self.replicas:
            raise ValueError(
                f"min_replicas ({self.min_replicas}) must be <= replicas ({self.replicas}); lower min_replicas"
            )
        h, f = self.inner.sync_every, self.exchange.fragments
        if h % f != 0:
            raise ValueError(f"inner.sync_every ({h}) must be a multiple of exchange.fragments ({f})")
        if self.exchange.fragment_sync_delay >= h // f:
            raise ValueError(
                f"exchange.fragment_sync_delay ({self.exchange.fragment_sync_delay}) must be smaller than "
                f"inner.sync_every / exchange.fragments ({h // f})"
            )
        _refuse_secrets(self.model_dump(mode="json"), "")
        return self

    # ---------------------------------------------------------------- loading
    @classmethod
    def from_toml(cls, path: str | Path) -> RunConfig:
        """Load and validate a TOML file. ConfigError names the file and field on failure."""
        return cls.load(str(path), [])

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
        """Load ``path`` (TOML; None = defaults) and apply dotted ``key=value`` overrides.

        Values are parsed as TOML literals (``3e-4``, ``true``, ``[0.9, 0.95]``, ``"x"``) and fall back
        to a plain string; ``none`` / ``null`` unset an optional field (``min_replicas=none``).
        Unknown keys raise ConfigError listing close matches; invalid values raise
        ConfigError naming the field and what it accepts.
        """
        raw: dict[str, Any] = _read_toml(Path(path)) if path is not None else {}
        source = str(path) if path is not None else "defaults"
        _check_known_keys(raw, cls, "", source)
        return cls._from_raw_with_overrides(raw, overrides or [], source)

    def with_overrides(self, overrides: list[str]) -> RunConfig:
        """A new, validated RunConfig: this one with dotted ``key=value`` overrides applied.

        Same syntax and errors as :meth:`load` (TOML literals, ``none``/``null`` unsets an
        optional field, unknown keys suggest close matches), but on top of this object's values
        rather than the defaults, so cross-field checks see them (``min_replicas=6`` is valid
        when this config has ``replicas=8``). ``self`` is never modified; no overrides returns
        an equal copy. Raises ConfigError naming the field and the ``--set`` source.
        """
        if isinstance(overrides, str):  # a lone "k=v" would otherwise be split into characters
            raise TypeError(f"with_overrides takes a list of 'key=value' strings, e.g. [{_quote(overrides)}]")
        return type(self)._from_raw_with_overrides(self.to_json_dict(), list(overrides), "config")

    @classmethod
    def _from_raw_with_overrides(cls, raw: dict[str, Any], overrides: list[str], source: str) -> RunConfig:
        """Apply ``overrides`` to the plain dict ``raw`` (edited in place) and validate it."""
        for item in overrides:
            key, value = _parse_override(item)
            _set_dotted(raw, key, value, cls)
        if overrides:
            source = f"{source} + --set {' '.join(_quote_override(o) for o in overrides)}"
        return cls.from_dict(raw, source=source)

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "dict") -> RunConfig:
        """Validate a plain dict (e.g. ``run.json``'s "config"); ConfigError on failure."""
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ConfigError(_format_validation_error(exc, source)) from None

    def to_json_dict(self) -> dict[str, Any]:
        """JSON-safe dict of every field (round-trips through :meth:`from_dict`); never holds secrets."""
        return self.model_dump(mode="json")

    @property
    def effective_min_replicas(self) -> int:
        """``min_replicas`` or ``replicas`` when unset."""
        return self.min_replicas if self.min_replicas is not None else self.replicas

    @property
    def run_url(self) -> str:
        """``<store>/<run_id>``."""
        return f"{self.store.rstrip('/')}/{self.run_id}"

    @staticmethod
    def field_paths() -> list[str]:
        """Every dotted field name (``inner.lr``, ``exchange.codec``, ...), for help and suggestions."""
        return sorted(_field_paths(RunConfig, ""))


# ------------------------------------------------------------------- helpers
def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            data: dict[str, Any] = tomllib.load(fh)
            return data
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist; pass an existing TOML file (see examples/)") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


def _field_paths(model: type[BaseModel], prefix: str) -> list[str]:
    out: list[str] = []
    for name, info in model.model_fields.items():
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.extend(_field_paths(ann, f"{prefix}{name}."))
        else:
            out.append(f"{prefix}{name}")
    return out


def _unknown_key_error(key: str, source: str) -> ConfigError:
    known = RunConfig.field_paths()
    close = difflib.get_close_matches(key, known, n=3, cutoff=0.5)
    if not close:  # also try the last component alone, e.g. "lr" -> inner.lr / outer.lr
        leaf = key.rsplit(".", 1)[-1]
        close = [k for k in known if k.rsplit(".", 1)[-1] == leaf][:3]
    hint = f"did you mean {', '.join(close)}?" if close else "see docs/config.md for the fields"
    return ConfigError(f"unknown config key {_quote(key)} (from {source}); {hint}")


def _check_known_keys(raw: dict[str, Any], model: type[BaseModel], prefix: str, source: str) -> None:
    for key, value in raw.items():
        info = model.model_fields.get(key)
        if info is None:
            raise _unknown_key_error(prefix + key, source)
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel) and isinstance(value, dict):
            _check_known_keys(value, ann, f"{prefix}{key}.", source)


def _parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"override {_quote(item)} must look like key=value, e.g. inner.lr=3e-4")
    key, text = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {_quote(item)} has no key; use e.g. inner.lr=3e-4")
    try:
        value: Any = tomllib.loads(f"v = {text.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = text.strip()
    return key, value


def _set_dotted(raw: dict[str, Any], key: str, value: Any, root: type[BaseModel]) -> None:
    parts = key.split(".")
    model: type[BaseModel] | None = root
    node = raw
    for i, part in enumerate(parts):
        info = model.model_fields.get(part) if model is not None else None
        if info is None:
            raise _unknown_key_error(key, "--set")
        ann = info.annotation
        is_section = isinstance(ann, type) and issubclass(ann, BaseModel)
        if i == len(parts) - 1:
            if is_section:
                raise ConfigError(f"--set {key}=... targets a whole section; set one of its fields, e.g. {key}.<field>")
            optional = type(None) in get_args(ann)
            node[part] = None if optional and isinstance(value, str) and value.lower() in ("none", "null") else value
            return
        if not is_section:
            raise _unknown_key_error(key, "--set")
        node = node.setdefault(part, {})
        model = cast(type[BaseModel], ann)


def _format_validation_error(exc: ValidationError, source: str) -> str:
    lines = [f"invalid config (from {source}):"]
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "<root>"
        desc = _describe(loc)
        got = f" (got {_quote(err['input'])})" if "input" in err and not isinstance(err["input"], dict) else ""
        msg = err["msg"].removeprefix("Value error, ")
        head = f"  {loc}: " if loc != "<root>" else "  "
        lines.append(f"{head}{msg}{got}" + (f" -- {desc}" if desc else ""))
    return "\n".join(lines)


def _describe(loc: str) -> str:
    model: type[BaseModel] = RunConfig
    info = None
    for part in loc.split("."):
        info = model.model_fields.get(part)
        if info is None:
            return ""
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            model = ann
    return (info.description or "") if info is not None else ""


def _refuse_secrets(obj: Any, path: str) -> None:
    if isinstance(obj, dict):
        for k, v in obj.items():
            _refuse_secrets(v, f"{path}.{k}" if path else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _refuse_secrets(v, f"{path}[{i}]")
    elif isinstance(obj, str):
        kind = find_secret(obj)
        if kind is not None:
            raise ValueError(
                f"{path} looks like it contains {kind}; credentials never go into the config or run.json -- "
                "pass them through the environment (AWS_*, GOOGLE_APPLICATION_CREDENTIALS, HF_TOKEN) or "
                "DILOCO_STORAGE_OPTIONS"
            )
