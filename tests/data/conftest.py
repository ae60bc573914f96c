"""Fixtures of the data tests: a tiny BPE tokenizer with a chat template, offline 🤗 datasets with a
private cache, and a tiny causal LM for the tokenizer (records and folders: ``hf_records.py``).

Nothing is downloaded: the tokenizer is trained on a few KB of text in the test, datasets are
written to ``tmp_path``, and the datasets library runs offline with its cache in a temporary folder.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from support.tiny_tokenizer import build_tokenizer


@pytest.fixture(scope="session")
def bpe_tokenizer() -> Any:
    """A byte-level BPE (vocabulary 400) trained on a few KB, EOS = pad, ChatML chat template."""
    return build_tokenizer()


@pytest.fixture(scope="session")
def bpe_model(bpe_tokenizer: Any) -> Any:
    """A 2-layer Qwen2 with the BPE tokenizer's vocabulary (random init) for compose_loss."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=len(bpe_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512, use_sliding_window=False,
    )
    return Qwen2ForCausalLM(cfg)


@pytest.fixture
def hf_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """🤗 datasets offline, with its cache under ``tmp_path`` (nothing outside it is written)."""
    datasets = pytest.importorskip("datasets")
    import huggingface_hub.constants as hub_constants

    cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True, raising=False)
    yield cache
