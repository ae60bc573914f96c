"""The example configs of examples/: each validates, its data section fits its loss channels, and
the data ones run the builder end to end on local stand-ins of their Hub datasets (same columns,
local parquet / jsonl folders, a tiny tokenizer) with compose_loss on the batches."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hf_records import chat_rows, pref_rows, text_rows, write_split

from diloco_serverless.config import RunConfig
from diloco_serverless.data.builder import DPO_KEYS, STUDENT_KEYS, TEACHER_KEYS, BatchBuilder, check_channels
from diloco_serverless.loss import compose_loss
from support import REPO_ROOT

EXAMPLES = sorted((REPO_ROOT / "examples").glob("*.toml"))
#: what each data example becomes locally: (split files to write, overrides, batch keys)
SMALL = ["data.seq_len=96", "data.batch_size=4", "data.hint_len=16", "data.eval_batches=2", "data.config=none"]


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_loads_and_its_data_fits_its_loss(path: Path) -> None:
    cfg = RunConfig.load(path)
    if cfg.data.format != "auto":
        check_channels(cfg.data.format, cfg.loss, 0)  # e.g. text with every other channel off
    if cfg.data.source.startswith("hf:"):
        text = path.read_text()
        assert "--executor modal" in text and "--executor hf-jobs" in text, "launch commands in a comment"
        assert "data" in text.split("extras=", 1)[1].split("]", 1)[0], "the replicas' image needs the data extra"


def _write(tmp: Path, kind: str) -> Path:
    folder = tmp / kind
    if kind == "text":  # FineWeb-Edu's column: text
        write_split(folder, "train", text_rows(160), "parquet", shards=4)
    elif kind == "chat":  # OpenR1-Math's columns: messages, answer
        write_split(folder, "train", chat_rows(60), "jsonl", shards=2)
    else:  # UltraFeedback binarized: prompt, chosen / rejected conversations, split train_prefs / test_prefs
        write_split(folder, "train", pref_rows(40), "parquet")
        write_split(folder, "test", pref_rows(10, seed=3), "parquet")
    return folder


CASES = [
    ("pretrain_text_fineweb.toml", "text", ["data.eval_fraction=0.1", "data.shuffle_buffer=16"], STUDENT_KEYS),
    ("chat_sft_self_distill.toml", "chat", ["data.eval_fraction=0.1"], STUDENT_KEYS + TEACHER_KEYS),
    ("preference_simpo.toml", "preference", ["data.split=train", "data.eval_split=test"], STUDENT_KEYS + DPO_KEYS),
]


@pytest.mark.parametrize("streaming", ["false", "true"])
@pytest.mark.parametrize(("name", "kind", "overrides", "keys"), CASES, ids=[c[0] for c in CASES])
@pytest.mark.usefixtures("hf_offline")
def test_data_examples_run_end_to_end_on_local_data(
    tmp_path: Path, bpe_tokenizer: Any, bpe_model: Any, name: str, kind: str, overrides: list[str],
    keys: tuple[str, ...], streaming: str,
) -> None:
    pytest.importorskip("datasets")
    path = REPO_ROOT / "examples" / name
    assert RunConfig.load(path).data.source.startswith("hf:")
    folder = _write(tmp_path, kind)
    cfg = RunConfig.load(path, [f'data.source="{folder}"', f"data.streaming={streaming}", *SMALL, *overrides])
    assert cfg.data.format == kind and not cfg.loss.needs_reference
    builder = BatchBuilder.from_config(cfg, bpe_tokenizer, rank=cfg.replicas - 1)
    batches = [builder.next_batch() for _ in range(3)]
    assert all(set(b) == set(keys) for b in batches)
    if kind == "text":
        efficiency = sum(float(b["attention_mask"].sum()) for b in batches) / sum(b["attention_mask"].numel()
                                                                                for b in batches)
        assert efficiency >= 0.99
    evals = list(builder.eval_batches())
    assert len(evals) == 2 and all(set(e) == set(STUDENT_KEYS) for e in evals)
    out = compose_loss(bpe_model, batches[0], **cfg.loss.compose_kwargs())
    assert torch.isfinite(out.total) and out.lm_ce > 0
    if kind == "chat":
        assert out.sdpo_jsd > 0
    if kind == "preference":
        assert out.trace_replay_dpo > 0
    builder.close()
