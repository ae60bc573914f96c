"""model.py: the tiny preset, its byte tokenizer, named models from a local dir, HF round trips."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from diloco_serverless.config import ModelConfig
from diloco_serverless.store.objectstore import ObjectStore
from diloco_serverless.trainer.model import (
    ModelLoadError,
    build_byte_tokenizer,
    build_model,
    count_parameters,
    download_pretrained,
    upload_pretrained,
)

TEXT = "def f(x):\n\treturn x  # héllo 🙂\n"


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_tiny_is_about_one_million_parameters_and_seeded() -> None:
    model, tok = build_model(ModelConfig(), seed=0)
    assert 0.9e6 <= count_parameters(model) <= 1.1e6
    assert model.config.model_type == "qwen2" and model.config.vocab_size == len(tok) == 259
    assert model.training
    assert _same_weights(model, build_model(ModelConfig(), seed=0)[0])
    assert not _same_weights(model, build_model(ModelConfig(), seed=1)[0])
    before = torch.rand(3)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model(ModelConfig(), seed=5)
    assert torch.equal(torch.rand(3), expected) and before.shape == (3,)  # global RNG untouched


def test_byte_tokenizer_is_lossless_and_byte_aligned() -> None:
    tok = build_byte_tokenizer()
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    assert ids == list(TEXT.encode("utf-8"))
    assert tok.decode(ids) == TEXT
    assert tok.eos_token == tok.pad_token == "<|endoftext|>" and tok.eos_token_id == 256
    assert tok("<|im_start|>")["input_ids"] == [257]
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_bfloat16() -> None:
    model, _ = build_model(ModelConfig(dtype="bfloat16"), seed=0)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_save_pretrained_round_trip_with_auto_classes(tmp_path: Path) -> None:
    model, tok = build_model(ModelConfig(), seed=0)
    model.save_pretrained(tmp_path, safe_serialization=True)
    tok.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    loaded_tok = AutoTokenizer.from_pretrained(tmp_path)
    assert _same_weights(model, loaded)
    assert loaded_tok(TEXT, add_special_tokens=False)["input_ids"] == list(TEXT.encode("utf-8"))
    assert loaded_tok.chat_template and loaded_tok.pad_token == "<|endoftext|>"
    ids = torch.tensor([list(b"import os\n")])
    model.eval()
    assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_named_model_from_local_dir(tmp_path: Path) -> None:
    model, tok = build_model(ModelConfig(), seed=3)
    model.save_pretrained(tmp_path)
    tok.pad_token = None  # a tokenizer without pad token (common for base models)
    tok.save_pretrained(tmp_path)
    named, named_tok = build_model(ModelConfig(name=str(tmp_path)), seed=0)  # seed ignored: pretrained
    assert _same_weights(model, named)
    assert named_tok.pad_token == named_tok.eos_token == "<|endoftext|>"
    bf16, _ = build_model(ModelConfig(name=str(tmp_path), dtype="bfloat16"))
    assert next(bf16.parameters()).dtype == torch.bfloat16


def test_missing_named_model_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="cannot load model.*use model.name=\"tiny\""):
        build_model(ModelConfig(name=str(tmp_path / "nope")))


def test_upload_and_download_through_a_store(memory_store_url: str, tmp_path: Path) -> None:
    model, tok = build_model(ModelConfig(), seed=0)
    store = ObjectStore(memory_store_url)
    keys = upload_pretrained(model, tok, store, "final")
    assert "final/model.safetensors" in keys and "final/config.json" in keys
    assert not any(k.endswith((".bin", ".pt", ".pkl")) for k in keys)
    local = download_pretrained(store, "final", tmp_path / "m")
    assert _same_weights(model, AutoModelForCausalLM.from_pretrained(local))
    assert AutoTokenizer.from_pretrained(local)("ab")["input_ids"] == [97, 98]
    with pytest.raises(FileNotFoundError, match="no model under"):
        download_pretrained(store, "missing", tmp_path / "x")
