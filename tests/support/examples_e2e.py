"""Local stand-ins for the Hub examples of ``examples/`` run end to end (tests/e2e/test_examples_e2e.py).

* :func:`save_tiny_model`: a tiny Qwen2 (random init) with a byte-level BPE tokenizer trained here on a
  few KB (EOS = pad, a ChatML chat template), written with ``save_pretrained`` into a folder that
  ``model.name`` can name: nothing is downloaded.
* :func:`write_example_data`: a local dataset folder with the columns (and, for UltraFeedback, the
  split names) of each example's Hub dataset: FineWeb-Edu's ``text`` (parquet shards), OpenR1-Math's
  ``messages`` + ``answer`` (jsonl shards), UltraFeedback binarized's ``prompt`` / ``chosen`` /
  ``rejected`` conversations in ``train_prefs`` / ``test_prefs`` (parquet, the Hub's file names).
* :func:`offline_env`: the environment replicas (real processes, which inherit the launcher's) need to
  read the data with 🤗 datasets without touching the network, with every cache under the test's folder.
* :func:`tensorboard_scalars`: a run's TensorBoard event files read back offline.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from support.tiny_tokenizer import build_tokenizer, sentence


def save_tiny_model(folder: Path) -> Path:
    """A 2-layer Qwen2 (hidden 32, random init, seed 0) + :func:`build_tokenizer`, saved with
    ``save_pretrained`` into ``folder``: what ``model.name`` names in place of a Hub id."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512, use_sliding_window=False,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
        tie_word_embeddings=False,
    )
    folder.mkdir(parents=True, exist_ok=True)
    Qwen2ForCausalLM(cfg).save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


# ------------------------------------------------------------------------------------ the data
def text_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """FineWeb-Edu-like documents of 5..60 words (plus an unread column, as the Hub's has several)."""
    rng = random.Random(seed)
    return [{"text": f"doc{i} " + sentence(rng, rng.randint(5, 60)), "id": f"<urn:{i}>"} for i in range(n)]


def chat_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """OpenR1-Math-like records: ``messages`` (user problem, assistant solution; every third one with a
    second exchange) and the final ``answer``, the hint the example's teacher reads."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        messages = [
            {"role": "user", "content": f"Q{i}: add {i} and {i + 1}"},
            {"role": "assistant", "content": f"A{i}: {sentence(rng, 6)} the sum is {2 * i + 1}"},
        ]
        if i % 3 == 0:
            messages += [
                {"role": "user", "content": f"Q{i}b: and {sentence(rng, 3)}?"},
                {"role": "assistant", "content": f"A{i}b: {sentence(rng, 4)}"},
            ]
        rows.append({"problem": f"add {i} and {i + 1}", "messages": messages, "answer": f"{2 * i + 1}"})
    return rows


def pref_rows(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """UltraFeedback-binarized-like records: ``prompt`` and ``chosen`` / ``rejected`` conversations
    that end with the assistant's answer, plus the scores the example does not read."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        prompt = f"Add {i} and {i + 1}."
        user = {"role": "user", "content": prompt}
        rows.append({
            "prompt": prompt, "prompt_id": f"{i:08x}",
            "chosen": [user, {"role": "assistant", "content": f"The sum is {2 * i + 1}. {sentence(rng, 3)}"}],
            "rejected": [user, {"role": "assistant", "content": f"The sum is {2 * i}. {sentence(rng, 3)}"}],
            "score_chosen": 8.0, "score_rejected": 3.0,
        })
    return rows


def _write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_example_data(folder: Path, kind: str) -> Path:
    """A local dataset folder standing in for the Hub dataset of the example of format ``kind``."""
    if kind == "text":  # FineWeb-Edu sample-10BT: parquet shards of one split, "train"
        rows = text_rows(240)
        for s in range(4):
            _write(folder / "data" / f"train-{s:05d}-of-00004.parquet", rows[s::4])
    elif kind == "chat":  # OpenR1-Math-220k default: "train"
        rows = chat_rows(120)
        for s in range(2):
            _write(folder / "data" / f"train-{s:05d}.jsonl", rows[s::2])
    elif kind == "preference":  # ultrafeedback_binarized: splits train_prefs / test_prefs (and others)
        _write(folder / "data" / "train_prefs-00000-of-00001.parquet", pref_rows(80))
        _write(folder / "data" / "test_prefs-00000-of-00001.parquet", pref_rows(16, seed=3))
        _write(folder / "data" / "train_sft-00000-of-00001.parquet", pref_rows(8, seed=5))
    else:
        raise ValueError(f"no stand-in data for format {kind!r}")
    return folder


# ------------------------------------------------------------------------------------ environment
def offline_env(tmp: Path) -> dict[str, str]:
    """Variables for the launcher and (inherited) its replicas: Hub and datasets offline, every cache
    (HF_HOME, the datasets' Arrow copies, XDG) under ``tmp``, one thread per process."""
    home = tmp / "hf-home"
    return {
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_HOME": str(home),
        "HF_DATASETS_CACHE": str(home / "datasets"),
        "XDG_CACHE_HOME": str(tmp / "xdg-cache"),
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }


# ------------------------------------------------------------------------------------ tracking
def tensorboard_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series of the TensorBoard event files under ``run_dir``: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
