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


# ---------------------------------------------------------------------------- your own model
LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def _save_tiny_llama(folder: Path) -> None:
    """A ~40k-parameter Llama with its own byte-level tokenizer (Llama-3-style special tokens, no pad
    token) and chat template, written with save_pretrained: what a user's local model folder holds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from diloco_serverless.trainer.model import _gpt2_bytes_to_unicode

    vocab = {ch: i for i, ch in enumerate(_gpt2_bytes_to_unicode())}
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    raw.decoder = decoders.ByteLevel()
    special = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    raw.add_special_tokens(special)
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token=special[0], eos_token=special[3])
    tok.chat_template = LLAMA_TEMPLATE
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=512, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)


def test_a_local_llama_folder_trains_with_its_own_tokenizer_and_chat_template(tmp_path: Path) -> None:
    from test_train import _train

    from support.diloco_harness import create_tiny_run, write_jsonl

    folder = tmp_path / "my-llama"
    _save_tiny_llama(folder)
    model, tok = build_model(ModelConfig(name=str(folder), attn_implementation="eager"))
    assert type(model).__name__ == "LlamaForCausalLM" and model.config._attn_implementation == "eager"
    assert tok.chat_template == LLAMA_TEMPLATE and tok.pad_token == tok.eos_token == "<|eot_id|>"
    data = write_jsonl(tmp_path / "data.jsonl")
    url = create_tiny_run(f"file://{tmp_path}/store", data, 1, rounds=2, **{
        "model.name": f'"{folder}"', "model.attn_implementation": "eager", "data.seq_len": 96})
    (result, trainer), = _train(url, [0]).values()
    assert result.final_written and result.rounds == 2 and result.eval_loss is not None
    text = tok.decode(trainer.data.next_batch()["input_ids"][0])
    assert text.startswith("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\ndef f"), text
    assert "<|start_header_id|>assistant<|end_header_id|>" in text, "the model's own chat template"
    final = download_pretrained(ObjectStore(url), "final", tmp_path / "final")
    loaded = AutoModelForCausalLM.from_pretrained(final)
    assert type(loaded).__name__ == "LlamaForCausalLM" and loaded.config.use_cache, "saved for generation"
    assert AutoTokenizer.from_pretrained(final).chat_template == LLAMA_TEMPLATE
    for name, tensor in trainer.rep.global_named_parameters().items():
        assert torch.equal(dict(loaded.named_parameters())[name].detach(), tensor), name


def test_attention_implementation_is_configurable() -> None:
    sdpa, _ = build_model(ModelConfig(), seed=0)
    eager, _ = build_model(ModelConfig(attn_implementation="eager"), seed=0)
    assert sdpa.config._attn_implementation == "sdpa" and eager.config._attn_implementation == "eager"
    ids = torch.tensor([list(b"import os\nx = 1\n"), list(b"def f(y): pass\n\0")])
    mask = torch.ones_like(ids)
    mask[1, -1] = 0
    torch.testing.assert_close(sdpa(input_ids=ids, attention_mask=mask).logits[mask.bool()],
                               eager(input_ids=ids, attention_mask=mask).logits[mask.bool()], rtol=1e-4, atol=1e-5)
    with pytest.raises(ModelLoadError, match="model.attn_implementation='no_such_kernel'"):
        build_model(ModelConfig(attn_implementation="no_such_kernel"))


def test_gradient_checkpointing_gives_the_same_gradients() -> None:
    plain, _ = build_model(ModelConfig(), seed=0)
    ckpt_model, _ = build_model(ModelConfig(gradient_checkpointing=True), seed=0)
    assert ckpt_model.is_activation_checkpointing and not plain.is_activation_checkpointing
    ids = torch.tensor([list(b"def f(x):\n    return x + 1\n")] * 2)
    for m in (plain, ckpt_model):
        m(input_ids=ids, labels=ids).loss.backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), ckpt_model.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")


def test_precision_sets_the_parameter_dtype_and_training_turns_the_cache_off(tmp_path: Path) -> None:
    from diloco_serverless.trainer.model import autocast

    dtypes = {p: {q.dtype for q in build_model(ModelConfig(precision=p))[0].parameters()}
              for p in ("fp32", "bf16-autocast", "bf16")}
    assert dtypes == {"fp32": {torch.float32}, "bf16-autocast": {torch.float32}, "bf16": {torch.bfloat16}}
    with autocast(ModelConfig(precision="bf16-autocast"), "cpu"):
        assert torch.is_autocast_enabled("cpu")
    with autocast(ModelConfig(precision="bf16"), "cpu"):
        assert not torch.is_autocast_enabled("cpu")
    model, tok = build_model(ModelConfig())
    assert model.config.use_cache is False, "training never reads a KV cache"
    store = ObjectStore(f"file://{tmp_path}/store")
    upload_pretrained(model, tok, store, "final")
    assert store.get_json("final/config.json")["use_cache"] is True and model.config.use_cache is False


def test_compile_compiles_the_model_and_the_reference_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """model.compile=true: nn.Module.compile on the trained model and on DPO's reference model (after
    the reference was copied); torch.compile is replaced by a recorder here (compiling takes minutes
    on a CPU), the step runs through the compiled call path."""
    from diloco_serverless.trainer.loop import ReplicaTrainer, _Segment
    from support.diloco_harness import create_tiny_run, write_jsonl

    compiled: list[object] = []

    def fake_compile(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
        compiled.append(fn.__self__)
        return fn

    monkeypatch.setattr(torch, "compile", fake_compile)
    data = write_jsonl(tmp_path / "data.jsonl")
    url = create_tiny_run(f"file://{tmp_path}/store", data, 1, rounds=1, **{"model.compile": "true"})
    trainer = ReplicaTrainer.from_run(url, 0)
    ref = trainer.data.ref_model
    assert compiled == [trainer.model, ref] and ref is not trainer.model
    assert trainer.model._compiled_call_impl is not None
    names = [n for n, _ in trainer.model.named_parameters()]
    assert names and not any(n.startswith("_orig_mod") for n in names)
    with trainer.rep:
        trainer._inner_step(_Segment())
    trainer.manager.shutdown()
    compiled.clear()
    plain = ReplicaTrainer.from_run(create_tiny_run(f"file://{tmp_path}/plain", data, 1, rounds=1), 0)
    assert compiled == [] and plain.model._compiled_call_impl is None
    plain.manager.shutdown()
