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
import math
import re
import secrets as _secrets
import tomllib
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, cast, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from diloco_serverless.errors import ConfigError

__all__ = [
    "ConfigError",
    "ModelConfig",
    "DataConfig",
    "DataColumns",
    "DataFormat",
    "HF_SOURCE_PREFIX",
    "MIN_RESPONSE_TOKENS",
    "InnerConfig",
    "OuterConfig",
    "LossConfig",
    "RLConfig",
    "ExchangeConfig",
    "RunConfig",
    "generate_run_id",
    "find_secret",
    "RUN_ID_PATTERN",
    "ROUND_TIMEOUT_S",
    "STRAGGLER_TIMEOUT_S",
    "TAKEOVER_TIMEOUT_S",
    "POLL_INTERVAL_S",
    "STORE_TIMEOUT_S",
    "tomllib",
    "Codec",
    "TRUST_REMOTE_CODE_ENV",
    "RUN_KEY_ENV",
    "TrackingConfig",
    "TrackingBackend",
    "HubConfig",
]

RUN_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


def generate_run_id() -> str:
    """A fresh, sortable run id such as ``run-20261129-214455-ab12`` (UTC time + 4 random hex)."""
    stamp = datetime.now(UTC).strftime("%Y%m%d-%H%M%S")
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
    precision: Literal["fp32", "bf16-autocast", "bf16"] = Field(
        "fp32",
        description='"fp32"; "bf16-autocast": fp32 parameters (master weights) and inner optimizer state, forward '
        'and backward under bf16 autocast; "bf16": bf16 parameters and inner optimizer state. The global '
        "parameters, outer momentum and the exchange's reduction stay fp32 in every mode.",
    )
    dtype: Literal["float32", "bfloat16"] | None = Field(
        None,
        description='Parameter dtype of the model replicas train; unset follows model.precision (bfloat16 for "bf16", '
        'float32 otherwise). "bfloat16" alone means precision "bf16".',
    )
    attn_implementation: str = Field(
        "sdpa",
        description='Attention kernel of the transformers model: "sdpa" (torch scaled_dot_product_attention), '
        '"eager", "flash_attention_2" (needs flash-attn), ...',
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations during backward: less activation memory, about a third more compute."
    )
    compile: bool = Field(
        False,
        description="torch.compile the model (in place); the first steps of each shape are slow while it compiles.",
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

    @field_validator("attn_implementation")
    @classmethod
    def _attn_not_empty(cls, v: str) -> str:
        if not v.strip() or v != v.strip():
            raise ValueError('must name an attention implementation such as "sdpa" or "eager"')
        return v

    @model_validator(mode="after")
    def _dtype_fits_precision(self) -> ModelConfig:
        if self.dtype == "float32" and self.precision == "bf16":
            raise ValueError(
                'model.precision="bf16" trains bfloat16 parameters; unset model.dtype or set it to "bfloat16"'
            )
        if self.dtype == "bfloat16" and self.precision == "bf16-autocast":
            raise ValueError(
                'model.precision="bf16-autocast" keeps fp32 master weights; unset model.dtype or set it to "float32"'
            )
        return self

    @property
    def param_dtype(self) -> Literal["float32", "bfloat16"]:
        """The dtype of the trained parameters: bfloat16 for precision "bf16" (or dtype "bfloat16")."""
        return "bfloat16" if self.precision == "bf16" or self.dtype == "bfloat16" else "float32"

    @property
    def autocast(self) -> bool:
        """True when forward and backward run under bf16 autocast (precision "bf16-autocast")."""
        return self.precision == "bf16-autocast"


def _largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of ``n`` that is <= ``at_most`` (for a micro_batch_size suggestion)."""
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


MIN_RESPONSE_TOKENS = 8
"""Least ``data.seq_len - data.prompt_len``: the stdlib builder needs >= 2 response tokens (two pieces
to shuffle into the rejected answer); 8 keeps the examples meaningful."""


DataFormat = Literal["auto", "text", "chat", "prompt_response", "preference", "prompt"]
#: ``data.source`` prefix of a Hugging Face Hub dataset (``hf:HuggingFaceFW/fineweb-edu``).
HF_SOURCE_PREFIX = "hf:"
_HF_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


class DataColumns(_Section):
    """Column names of a datasets source (``data.columns.prompt = "question"``); docs/data.md."""

    text: str = Field("text", description='format "text": the column holding each document.')
    messages: str = Field("messages", description='format "chat": the column of [{role, content}, ...] messages.')
    prompt: str = Field("prompt", description="prompt_response / preference: the prompt (a string or messages).")
    response: str = Field("response", description="prompt_response: the response string.")
    chosen: str = Field("chosen", description="preference (optional in prompt_response): the preferred response.")
    rejected: str = Field("rejected", description="preference (optional in prompt_response): the rejected response.")
    hint: str = Field("hint", description="Optional: the hint the self-distillation teacher reads (chat, ...).")

    @field_validator("*")
    @classmethod
    def _column_not_empty(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must name a column, not be empty")
        return v


class DataConfig(_Section):
    """Training data and batching (``diloco_serverless.data``)."""

    source: str = Field(
        "stdlib",
        description='"stdlib" (the Python standard library\'s own .py files), "hf:<repo id>" (a Hugging Face Hub '
        "dataset), or a local path / fsspec URL (s3://, gs://, ...) of a JSONL file, of parquet / jsonl / json / "
        "csv / arrow / txt files (a file, glob or folder) or of a save_to_disk folder. docs/data.md.",
    )
    format: DataFormat = Field(
        "auto",
        description='"text" (packed continued pretraining), "chat" (messages), "prompt_response", "preference", or '
        '"auto": stdlib and a .jsonl file keep their own reader, datasets sources are detected from the columns.',
    )
    columns: DataColumns = Field(default_factory=DataColumns, description="[data.columns] section.")
    config: str | None = Field(None, description="datasets sources: the dataset configuration (subset) name.")
    split: str = Field("train", description="datasets sources: the split replicas train on.")
    eval_split: str | None = Field(
        None, description="datasets sources: a split to evaluate on; unset holds out data.eval_fraction instead."
    )
    revision: str | None = Field(None, description="hf: sources: Hub revision (branch, tag or commit).")
    streaming: bool | None = Field(
        None, description="datasets sources: stream records instead of preparing a local copy; unset = on for hf:."
    )
    shuffle_buffer: int = Field(
        1000, ge=1, le=1_000_000, description="Streamed sources: records shuffled together (a seeded window)."
    )
    prefetch: int = Field(
        2, ge=0, le=64, description="Batches a background thread tokenizes ahead of the inner loop; 0 = inline."
    )
    seq_len: int = Field(128, ge=16, le=32768, description="Tokens per student sequence (prompt + response).")
    batch_size: int = Field(8, ge=1, description="Sequences per inner step per replica.")
    micro_batch_size: int | None = Field(
        None,
        ge=1,
        description="Sequences per forward/backward pass: each inner step accumulates batch_size / micro_batch_size "
        "passes into the gradient of the whole batch. Must divide data.batch_size; unset = batch_size (one pass).",
    )
    prompt_len: int = Field(
        32, ge=1, description="stdlib corpus: max tokens of preceding code used as the prompt (<= seq_len - 8)."
    )
    hint_len: int = Field(
        64,
        ge=0,
        description="Max tokens the hint adds to the self-distillation teacher's prompt (stdlib: the file path + "
        "module docstring; other sources: the hint column).",
    )
    eval_fraction: float = Field(
        0.05, gt=0.0, lt=1.0,
        description="Share of files (stdlib) or records held out for eval, by hash; unused with data.eval_split.",
    )
    eval_batches: int = Field(4, ge=1, description="Batches of the held-out split per evaluation.")
    max_bad_fraction: float = Field(
        0.01, ge=0.0, le=1.0,
        description="datasets and JSONL sources: share of rows that may be unusable (skipped, counted in the metrics "
        "as data_bad_rows, named in a warning) before the run stops with an error naming examples; 0 = none.",
    )

    @field_validator("source")
    @classmethod
    def _source_form(cls, v: str) -> str:
        if not v.strip():
            raise ValueError('must be "stdlib", "hf:<repo id>" or a path / URL of your data')
        if v.startswith(HF_SOURCE_PREFIX) and not _HF_REPO_ID.match(v[len(HF_SOURCE_PREFIX):]):
            raise ValueError('must name a Hub dataset after "hf:", e.g. "hf:HuggingFaceFW/fineweb-edu"')
        return v

    @model_validator(mode="after")
    def _source_options(self) -> DataConfig:
        """Options of the datasets reader are refused where they would be ignored."""
        if self.source == "stdlib":
            options = ("config", "eval_split", "revision", "streaming")
            given = [f"data.{k}" for k in options if getattr(self, k) is not None]
            if self.format != "auto" or given:
                raise ValueError(
                    f'data.source="stdlib" has its own examples; {", ".join(given) or "data.format"} applies to '
                    '"hf:..." and file sources only (unset it, or point data.source at your data)'
                )
        if self.eval_split is not None and self.eval_split == self.split:
            raise ValueError(
                f"data.eval_split ({self.eval_split!r}) must differ from data.split: evaluating on training data; "
                "unset it to hold out data.eval_fraction instead"
            )
        return self

    @field_validator("micro_batch_size")
    @classmethod
    def _micro_divides_batch(cls, v: int | None, info: ValidationInfo) -> int | None:
        batch = info.data.get("batch_size")
        if v is not None and isinstance(batch, int) and batch % v != 0:
            raise ValueError(f"must divide data.batch_size ({batch}); e.g. {_largest_divisor(batch, v)}")
        return v

    @model_validator(mode="after")
    def _room_for_a_response(self) -> DataConfig:
        """The stdlib response budget is ``seq_len - prompt_len`` tokens; below
        ``MIN_RESPONSE_TOKENS`` the examples would be a few tokens (or impossible: < 2). Other
        sources do not read prompt_len."""
        if self.source == "stdlib" and self.seq_len - self.prompt_len < MIN_RESPONSE_TOKENS:
            raise ValueError(
                f"data.prompt_len ({self.prompt_len}) must be smaller than data.seq_len ({self.seq_len}) by at "
                f"least {MIN_RESPONSE_TOKENS} tokens (the response budget seq_len - prompt_len is "
                f"{self.seq_len - self.prompt_len}); set data.prompt_len <= {self.seq_len - MIN_RESPONSE_TOKENS} "
                f"or data.seq_len >= {self.prompt_len + MIN_RESPONSE_TOKENS}"
            )
        return self


#: H of the first rounds with ``inner.sync_every = "auto"``, before any timing is measured: the H with the fewest
#: tokens to DP's loss in the outer sweep at N = 4 (docs/replica.md), and short enough that a slow store
#: costs one short round before rank 0 measures it.
AUTO_SYNC_INITIAL = 8


class InnerConfig(_Section):
    """The inner optimizer (AdamW) every replica runs for ``sync_every`` steps between syncs."""

    lr: float = Field(3e-3, gt=0.0, le=1.0, description="AdamW peak learning rate.")
    warmup_steps: int = Field(20, ge=0, description="Linear warmup of the inner lr, in inner steps.")
    weight_decay: float = Field(0.1, ge=0.0, description="AdamW decoupled weight decay.")
    grad_clip: float = Field(1.0, ge=0.0, description="Max global grad norm per inner step; 0 disables clipping.")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW (beta1, beta2).")
    sync_every: int = Field(16, ge=1, description="H: inner steps per round (between outer syncs of the whole model); "
                            "\"auto\": decided at run time (inner.auto_sync).")
    schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description="Inner lr after the warmup, over the whole run (rounds x sync_every inner steps): constant, or "
        "linear / cosine decay to lr x min_lr_ratio at the last step; a function of the global inner step.",
    )
    min_lr_ratio: float = Field(
        0.1, ge=0.0, le=1.0, description="Final inner lr of the linear and cosine schedules, as a fraction of inner.lr."
    )
    auto_sync: bool = Field(
        False,
        description='H decided at run time (what inner.sync_every = "auto" sets): rank 0 picks each round\'s H from '
        "measured compute and exchange times, starting at sync_every; the run stays rounds x sync_every inner steps "
        "(docs/replica.md, \"H decided at run time\").",
    )
    auto_sync_min: int = Field(4, ge=1, description="With auto_sync: the smallest H rank 0 may pick.")
    auto_sync_max: int = Field(128, ge=1, description="With auto_sync: the largest H rank 0 may pick.")

    @model_validator(mode="before")
    @classmethod
    def _sync_every_auto(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("sync_every"), str) \
                and data["sync_every"].strip().lower() == "auto":
            return {**data, "sync_every": AUTO_SYNC_INITIAL, "auto_sync": True}
        return data

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"both betas must lie in [0, 1), got {list(v)}")
        return v

    def lr_at(self, step: int, total_steps: int) -> float:
        """Inner lr of global inner step ``step`` (0-based) of a run of ``total_steps`` inner steps.

        Linear warmup ``lr * (step + 1) / warmup_steps`` for the first ``warmup_steps`` steps, then
        ``schedule`` from ``lr`` at the first step after the warmup to ``lr * min_lr_ratio`` at the last
        step ``total_steps - 1`` (constant: ``lr``); later steps keep the final value.
        """
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.schedule == "constant":
            return self.lr
        progress = min(1.0, (step - self.warmup_steps) / max(1, total_steps - 1 - self.warmup_steps))
        decay = 1.0 - progress if self.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.lr * (self.min_lr_ratio + (1.0 - self.min_lr_ratio) * decay)


class OuterConfig(_Section):
    """The outer optimizer applied to the averaged pseudo-gradient (DiLoCo: Nesterov SGD)."""

    lr: float = Field(0.7, gt=0.0, le=10.0, description="Outer SGD learning rate (DiLoCo default 0.7; with none "
                      "of lr, momentum, nesterov set: the measured default for the run's N and H, docs/replica.md).")
    momentum: float = Field(0.9, ge=0.0, lt=1.0, description="Outer SGD momentum (DiLoCo default 0.9).")
    nesterov: bool = Field(True, description="Nesterov momentum (DiLoCo default true).")
    delay: int = Field(
        0, ge=0, le=1,
        description="1: overlap each round's exchange with the next round's inner steps; the averaged update is "
        "applied one round late (one-step-delay DiLoCo, arXiv 2502.12996; docs/replica.md). Needs "
        "exchange.fragments = 1, exchange.fragment_sync_delay = 0 and parallel.devices = 1.",
    )
    eager: bool = Field(
        True,
        description="With delay = 1: start each round from the new global parameters plus this replica's own "
        "progress of the round before (eager); false starts from the global parameters alone.",
    )
    lr_schedule: list[tuple[int, float]] | None = Field(
        None,
        description="Piecewise-constant outer lr: [[from_round, lr], ...], from_round >= 1 strictly increasing, "
        "0 < lr <= 10; the outer step that ends round r uses the lr of the last entry with from_round <= r "
        "(outer.lr before the first). A function of the round number: the same on every replica, on replay and "
        "after a resume. E.g. Covenant-72B's 1 then 0.65: outer.lr = 1.0, lr_schedule = [[R, 0.65]].",
    )

    @model_validator(mode="after")
    def _nesterov_needs_momentum(self) -> OuterConfig:
        if self.nesterov and self.momentum == 0.0:
            raise ValueError("outer.nesterov=true needs outer.momentum > 0; set a momentum or nesterov=false")
        return self

    @model_validator(mode="after")
    def _schedule_is_piecewise(self) -> OuterConfig:
        prev = 0
        for from_round, lr in self.lr_schedule or ():
            if from_round <= prev:
                raise ValueError(
                    f"outer.lr_schedule: round {from_round} must be >= 1 and greater than the entry before "
                    f"({prev}): give [[from_round, lr], ...] in increasing rounds (round 0 uses outer.lr)"
                )
            if not (math.isfinite(lr) and 0.0 < lr <= 10.0):
                raise ValueError(f"outer.lr_schedule: lr {lr} from round {from_round} must be > 0 and <= 10 "
                                 "(as outer.lr)")
            prev = from_round
        return self

    def lr_at(self, round_: int) -> float:
        """The outer lr of the step that ends round ``round_`` (0-based): ``lr_schedule``'s last entry at or
        before it, else ``lr``."""
        lr = self.lr
        for from_round, value in self.lr_schedule or ():
            if from_round > round_:
                break
            lr = value
        return lr


#: The outer step (lr, momentum, nesterov) a run gets when its config sets none of outer.lr, outer.momentum
#: and outer.nesterov, by (replicas, inner.sync_every, outer.delay): the lowest loss at equal tokens in
#: benchmarks/outer_sweep.py (tiny Qwen2, 96 inner steps per replica from random init; the table and its
#: limits are in docs/replica.md, "Outer defaults by (N, H)"). The nearest measured (N, H) answers for
#: the others (on a log scale, N first).
OUTER_DEFAULTS: dict[tuple[int, int, int], tuple[float, float, bool]] = {
    (2, 8, 0): (1.0, 0.0, False),
    (2, 16, 0): (1.0, 0.0, False),
    (2, 32, 0): (1.0, 0.0, False),
    (4, 8, 0): (1.0, 0.0, False),
    (4, 16, 0): (1.0, 0.0, False),
    (4, 32, 0): (1.0, 0.0, False),
    (4, 8, 1): (1.0, 0.0, False),
    (4, 16, 1): (1.0, 0.0, False),
    (8, 8, 0): (1.0, 0.0, False),
    (8, 16, 0): (1.0, 0.0, False),
}


def outer_defaults(replicas: int, sync_every: int, delay: int = 0) -> tuple[float, float, bool]:
    """The measured outer (lr, momentum, nesterov) nearest to ``(replicas, sync_every)`` for ``delay``."""
    keys = [k for k in OUTER_DEFAULTS if k[2] == delay] or list(OUTER_DEFAULTS)
    best = min(keys, key=lambda k: (abs(math.log2(k[0] / replicas)), abs(math.log2(k[1] / sync_every)), k))
    return OUTER_DEFAULTS[best]


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
    channel1: Literal["lm", "grpo", "dppo"] = Field(
        "lm",
        description='Channel 1: "lm" (cross-entropy on the data), or RL on rollouts sampled in the replica: "grpo" '
        "(TRL's GRPO family, rl.loss_type) or \"dppo\" (PRIME-RL's DPPO-clip); needs data.format=\"prompt\" and [rl].",
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


class RLConfig(_Section):
    """Rollouts, rewards and the RL loss of channel 1 (``loss.channel1 = "grpo" | "dppo"``); docs/rl.md.

    Names and defaults follow TRL's ``GRPOConfig`` (and PRIME-RL's loss config for the ``dppo_*`` keys).
    Each inner step reads ``data.batch_size`` prompts and samples ``num_generations`` completions of each."""

    num_generations: int = Field(8, ge=2, description="G: completions sampled per prompt (a group).")
    max_completion_length: int = Field(256, ge=1, description="Most tokens sampled per completion.")
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature (the loss's log-probs use it too).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling; 1 = off.")
    top_k: int = Field(0, ge=0, description="Top-k sampling; 0 = off.")
    num_iterations: int = Field(
        1, ge=1, description="Inner steps per generation batch (ratios vs the sampling policy)."
    )
    generation_backend: Literal["transformers"] = Field(
        "transformers", description="Who samples: model.generate with a KV cache (a colocated vLLM plugs in here)."
    )
    reward_funcs: list[str] = Field(
        default_factory=list,
        description='Reward functions by import path "module:function", TRL signature f(prompts, completions, '
        "**columns) -> list[float | None]; built-ins in diloco_serverless.rl.rewards.",
    )
    reward_weights: list[float] | None = Field(None, description="One weight per reward function; unset = all 1.")
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="Advantage scaling: group std, batch std, or none (Dr. GRPO)."
    )
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = Field("dapo", description="GRPO normalisation (TRL's).")
    epsilon: float = Field(0.2, ge=0.0, description="Lower clip of the ratio (1 - epsilon).")
    epsilon_high: float | None = Field(None, ge=0.0, description="Upper clip (1 + epsilon_high); unset = epsilon.")
    delta: float | None = Field(None, gt=1.0, description="Two-sided clip: ratio capped at delta (INTELLECT-2).")
    beta: float = Field(0.0, ge=0.0, description="k3 KL weight against the frozen initial model; 0 = no reference.")
    importance_sampling_level: Literal["token", "sequence"] = Field("token", description="Ratio per token or GSPO.")
    dppo_mask_high: float = Field(0.2, ge=0.0, description="DPPO: probability rise past which A > 0 tokens drop.")
    dppo_mask_low: float = Field(0.2, ge=0.0, description="DPPO: probability fall past which A < 0 tokens drop.")
    adv_tau: float = Field(1.0, ge=0.0, description="DPPO: advantage scale.")
    kl_tau: float = Field(1e-3, ge=0.0, description="DPPO: weight of the squared log-ratio KL.")

    @field_validator("reward_funcs")
    @classmethod
    def _import_paths(cls, v: list[str]) -> list[str]:
        for name in v:
            module, _, func = name.partition(":")
            if not module.strip() or not func.strip():
                raise ValueError(f'{name!r} is not "module:function" (e.g. "diloco_serverless.rl.rewards:format")')
        return v

    @model_validator(mode="after")
    def _weights_match(self) -> RLConfig:
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(
                f"rl.reward_weights has {len(self.reward_weights)} weights for {len(self.reward_funcs)} "
                "rl.reward_funcs; give one weight per function or leave it unset"
            )
        return self


#: Set to "1" by the launcher in every replica's environment when it was given --trust-remote-code;
#: replicas honour model.trust_remote_code only then, never from the stored config alone.
TRUST_REMOTE_CODE_ENV = "DILOCO_TRUST_REMOTE_CODE"
#: The environment variable that carries the run key to replicas (diloco_serverless.run.integrity).
#: Its name marks it a secret, so the executors never send it as plain configuration.
RUN_KEY_ENV = "DILOCO_RUN_KEY"

#: Pseudo-gradient codecs on the wire (implemented in diloco_serverless.exchange.codec).
Codec = Literal["fp32", "bf16", "int8", "sparse"]

#: Exchange deadlines and polling, in seconds: the one definition of their defaults, used by
#: ExchangeConfig, ObjectStoreAllReduce and ObjectStoreManager alike.
ROUND_TIMEOUT_S = 1800.0
STRAGGLER_TIMEOUT_S = 60.0
TAKEOVER_TIMEOUT_S = 60.0
POLL_INTERVAL_S = 0.5

#: Default deadline of one store operation (a GET, PUT or LIST with its retries) made for a run:
#: by the launcher (create the run, record the launch, status reads) and by the replicas that
#: apply the run's ``store_timeout_s``. Long enough for a slow request, short enough that an
#: endpoint which accepts connections and never answers fails within a minute.
STORE_TIMEOUT_S = 60.0
#: Large objects travel as parts of this many MiB, this many at a time (store.TransferPolicy): one
#: request moves ~50-100 MB/s on a real store, 8 parallel 16 MiB parts reach a 10 Gbit/s NIC.
STORE_PART_SIZE_MB = 16.0
STORE_PART_CONCURRENCY = 8
#: Hedged reads (store.hedge): a read slower than this quantile of recent ones gets a backup request.
STORE_HEDGE_QUANTILE = 0.75


class SparseConfig(_Section):
    """The ``sparse`` codec (diloco_serverless.exchange.sparse; SparseLoCo, arXiv 2508.15706): of every
    ``chunk`` values the ``k`` largest in magnitude, each a packed index and a ``bits``-bit code of a
    per-chunk scale. The defaults (64 of 4,096, 2 bits) are 0.227 bits per parameter."""

    chunk: int = Field(4096, ge=16, le=65536, description="Values per chunk (a power of two, 16 to 65,536).")
    k: int = Field(64, ge=1, description="Values kept per chunk (at most chunk).")
    bits: Literal[2, 4, 8] = Field(2, description="Bits of each kept value's code (a sign and bits-1 magnitude bits).")

    @model_validator(mode="after")
    def _chunk_and_k(self) -> SparseConfig:
        if self.chunk & (self.chunk - 1):
            raise ValueError(f"exchange.sparse.chunk must be a power of two (e.g. 4096), got {self.chunk}")
        if self.k > self.chunk:
            raise ValueError(f"exchange.sparse.k ({self.k}) must be at most exchange.sparse.chunk ({self.chunk})")
        return self


class ExchangeConfig(_Section):
    """How pseudo-gradients travel through the store (``ObjectStoreAllReduce``)."""

    codec: Codec = Field("fp32", description="Pseudo-gradient codec on the wire.")
    error_feedback: bool = Field(False, description="Add the codec's residual to the next round (lossy codecs).")
    feedback_decay: float = Field(
        1.0, ge=0.0, le=1.0, description="Error feedback: the residual is scaled by this before it is added "
        "(SparseLoCo's beta, 0.95; 1 keeps it whole)."
    )
    sparse: SparseConfig = Field(default_factory=SparseConfig, description="[exchange.sparse] section.")
    fragments: int = Field(1, ge=1, description="Streaming DiLoCo fragments; must divide inner.sync_every.")
    fragment_sync_delay: int = Field(
        0, ge=0, description="Inner steps a fragment's exchange overlaps with training (Streaming DiLoCo tau)."
    )
    fragment_merge: Literal["replace", "eager"] = Field(
        "replace", description="At a sync with fragment_sync_delay > 0: 'replace' sets the replica to the new global "
        "parameters (the tau steps are discarded); 'eager' adds its own progress of those tau steps to them "
        "(one fragment, one device)."
    )
    straggler_timeout_s: float = Field(
        STRAGGLER_TIMEOUT_S,
        gt=0.0,
        description="After publishing, wait this long for the others before a round closes without them "
        "(a partial quorum, or tombstones at N <= 16).",
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
    topology: Literal["flat", "hierarchical", "direct", "auto"] = Field(
        "auto",
        description="Exchange protocol: flat (O(N) requests per replica), hierarchical (groups of ~sqrt(N), "
        "O(sqrt N) requests), direct (whole tensors: fewest round trips, (N-1) x P down) or auto (direct at N=2 "
        "and for small tensors below 64 replicas, flat for larger ones, hierarchical from 64).",
    )

    @property
    def wire_codec(self) -> str:
        """The codec name the exchange writes: ``codec``, or for ``sparse`` its full name with the layout
        (``sparse-64of4096-2bit``), which every object's header and ready marker carry."""
        if self.codec != "sparse":
            return self.codec
        return f"sparse-{self.sparse.k}of{self.sparse.chunk}-{self.sparse.bits}bit"


#: How a replica's local processes share its work (``parallel.strategy``).
ParallelStrategy = Literal["ddp", "fsdp"]


class ParallelConfig(_Section):
    """Devices per replica: a replica is a node of G devices (one local process each), DiLoCo between
    replicas. Inside a replica the inner steps run data-parallel over the G processes; between
    replicas local rank g exchanges slice g (1/G) of every pseudo-gradient (docs/executors.md); with
    strategy "fsdp" the model is sharded over the G processes and slice g is local rank g's shards."""

    devices: int = Field(
        1, ge=1, le=64,
        description="G: local processes (devices) per replica; the replica's batch is split over them.",
    )
    strategy: ParallelStrategy = Field(
        "ddp", description="Inside a replica: 'ddp' (each device holds the whole model, gradients all-reduced over "
        "the G processes) or 'fsdp' (FSDP2: each device holds 1/G of the parameters, gradients and AdamW state; "
        "its exchange slice and outer momentum are its shards).",
    )

    @model_validator(mode="after")
    def _fsdp_needs_devices(self) -> ParallelConfig:
        if self.strategy == "fsdp" and self.devices < 2:
            raise ValueError(
                f"strategy 'fsdp' shards the model over the replica's devices, but devices={self.devices}; "
                "set parallel.devices to 2 or more, or use strategy 'ddp'"
            )
        return self


#: Experiment trackers ``tracking.backends`` may name (diloco_serverless.tracking; each an optional extra).
TrackingBackend = Literal["trackio", "wandb", "tensorboard"]


class TrackingConfig(_Section):
    """Experiment tracking (``diloco_serverless.tracking``): the launcher logs the run's per-round series."""

    backends: list[TrackingBackend] = Field(
        default_factory=list,
        description='Trackers the launcher logs each round to while it follows the run (and `diloco track`): '
        '"trackio", "wandb", "tensorboard"; each needs its extra. Empty = no tracking.',
    )
    project: str = Field(
        "diloco", description="trackio / W&B project the run is logged under (the run's name is its run_id)."
    )
    per_replica: bool = Field(
        False, description="Also log each replica's own series (replica/<rank>/loss, tokens_per_s, bytes, ...)."
    )
    tensorboard_dir: str = Field(
        "./tensorboard", description="Local folder of the TensorBoard event files, one subfolder per run_id."
    )

    @field_validator("backends", mode="before")
    @classmethod
    def _backends_from_text(cls, v: Any) -> Any:
        """``--set tracking.backends=wandb,tensorboard`` (a plain string) means the list of those names."""
        if isinstance(v, str):
            return [part.strip() for part in v.split(",") if part.strip()]
        return v

    @field_validator("backends")
    @classmethod
    def _backends_unique(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError(f"names a backend twice ({v}); list each of trackio, wandb, tensorboard once")
        return v

    @field_validator("project", "tensorboard_dir")
    @classmethod
    def _not_blank(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must not be empty")
        return v


#: ``ORG/NAME`` of a Hub model repository: two names of letters, digits, ``-``, ``_``, ``.``.
_HUB_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
_HUB_REPO_ID = re.compile(rf"^{_HUB_NAME}/{_HUB_NAME}$")


class HubConfig(_Section):
    """Where ``diloco launch --push-to-hub`` / ``diloco push`` upload the final model (``launcher.hub``)."""

    repo_id: str | None = Field(
        None,
        description='Hub model repository "ORG/NAME" the final model and its model card are pushed to when the run '
        "succeeds (diloco launch --push-to-hub); unset = no push. The token comes from HF_TOKEN or `hf auth login`.",
    )
    private: bool = Field(
        True, description="Create the repository private (an existing repository keeps its visibility)."
    )

    @field_validator("repo_id")
    @classmethod
    def _repo_id_form(cls, v: str | None) -> str | None:
        if v is not None and (not _HUB_REPO_ID.match(v) or "--" in v or ".." in v):
            raise ValueError('must be a Hub model repository "ORG/NAME", e.g. "my-org/smollm2-diloco"')
        return v


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
    store_timeout_s: float = Field(
        STORE_TIMEOUT_S,
        gt=0.0,
        allow_inf_nan=False,
        description="Deadline in seconds of one store operation (retries included) made for this run, by the "
        "launcher and the replicas; must fit the largest single transfer (a checkpoint shard).",
    )
    store_part_size_mb: float = Field(
        STORE_PART_SIZE_MB,
        ge=5.0,
        le=5120.0,
        allow_inf_nan=False,
        description="S3 and GCS objects larger than this (MiB) go up in parts (S3 multipart, GCS composite) and "
        "come down as ranged GETs of this size, and the exchange cuts its objects to at most this size; smaller "
        "ones are one request. At least 5 (S3's smallest part).",
    )
    store_part_concurrency: int = Field(
        STORE_PART_CONCURRENCY, ge=1, le=64, description="Parts of one large object in flight at once (S3, GCS)."
    )
    store_hedge_quantile: float | None = Field(
        STORE_HEDGE_QUANTILE,
        gt=0.0,
        lt=1.0,
        description="A read (GET, listing) slower than this quantile of the store's recent answer times is sent "
        "again and the first answer wins (S3, GCS); unset = never.",
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
    rl: RLConfig = Field(default_factory=RLConfig, description="[rl] section (loss.channel1 grpo / dppo).")
    exchange: ExchangeConfig = Field(default_factory=ExchangeConfig, description="[exchange] section.")
    parallel: ParallelConfig = Field(default_factory=ParallelConfig, description="[parallel] section.")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="[tracking] section.")
    hub: HubConfig = Field(default_factory=HubConfig, description="[hub] section.")

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
        if self.outer.delay and (f != 1 or self.exchange.fragment_sync_delay or self.parallel.devices > 1):
            raise ValueError(
                "outer.delay = 1 overlaps whole-model rounds on one device: it needs exchange.fragments = 1, "
                f"exchange.fragment_sync_delay = 0 and parallel.devices = 1 (got {f}, "
                f"{self.exchange.fragment_sync_delay}, {self.parallel.devices}); set outer.delay = 0 or change those"
            )
        if self.exchange.fragment_merge == "eager":
            self._check_fragment_merge()
        if self.inner.auto_sync:
            self._check_auto_sync()
        if not self.outer.model_fields_set & {"lr", "momentum", "nesterov"}:  # none set: by (N, H)
            lr, momentum, nesterov = outer_defaults(self.replicas, h, self.outer.delay)
            outer = OuterConfig(lr=lr, momentum=momentum, nesterov=nesterov, delay=self.outer.delay,
                                eager=self.outer.eager, lr_schedule=self.outer.lr_schedule)
            object.__setattr__(self, "outer", outer)  # no re-validation: the fields were just validated
        if self.loss.channel1 != "lm":
            if not self.rl.reward_funcs:
                raise ValueError(
                    f'loss.channel1="{self.loss.channel1}" needs rl.reward_funcs, e.g. '
                    '["diloco_serverless.rl.rewards:exact_match"]'
                )
            if self.data.format != "prompt":
                raise ValueError(
                    f'loss.channel1="{self.loss.channel1}" samples completions of prompts: set data.format="prompt"'
                )
            if self.inner.sync_every % self.rl.num_iterations:
                raise ValueError(
                    f"inner.sync_every ({self.inner.sync_every}) must be a multiple of rl.num_iterations "
                    f"({self.rl.num_iterations}): a generation batch never spans two rounds"
                )
            if self.parallel.devices > 1:
                raise ValueError(
                    f'loss.channel1="{self.loss.channel1}" runs on one device per replica for now; set '
                    "parallel.devices=1 (more replicas instead)"
                )
        _refuse_secrets(self.model_dump(mode="json"), "")
        return self

    def _check_fragment_merge(self) -> None:
        ex = self.exchange
        if ex.fragment_sync_delay == 0 or ex.fragments != 1 or self.parallel.devices > 1:
            raise ValueError(
                'exchange.fragment_merge = "eager" keeps the steps trained while one whole-model exchange is in '
                "flight: it needs exchange.fragment_sync_delay > 0, exchange.fragments = 1 and parallel.devices = 1 "
                f"(got {ex.fragment_sync_delay}, {ex.fragments}, {self.parallel.devices}); set "
                'exchange.fragment_merge = "replace" or change those'
            )

    def _check_auto_sync(self) -> None:
        inner, ex = self.inner, self.exchange
        if not inner.auto_sync_min <= inner.sync_every <= inner.auto_sync_max:
            raise ValueError(
                f"inner.auto_sync: the first rounds' H, inner.sync_every ({inner.sync_every}), must lie in "
                f"inner.auto_sync_min..auto_sync_max ({inner.auto_sync_min}..{inner.auto_sync_max}); change one"
            )
        if ex.fragments != 1 or self.parallel.devices > 1 or self.loss.channel1 != "lm":
            raise ValueError(
                'inner.sync_every = "auto" decides whole-model rounds of language modelling on one device: it needs '
                "exchange.fragments = 1, parallel.devices = 1 and "
                f'loss.channel1 = "lm" (got {ex.fragments}, {self.parallel.devices}, '
                f'"{self.loss.channel1}"); set a number for inner.sync_every or change those'
            )

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
