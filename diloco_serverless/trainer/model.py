"""Models and tokenizers: the ``tiny`` preset (built locally) or a Hugging Face model by name.

``build_model(cfg.model, seed)`` returns ``(model, tokenizer)``:

* ``"tiny"``: a ``transformers`` Qwen2 (Qwen2 technical report, arXiv 2407.10671) of about 1M
  parameters (hidden 128, 4 layers, 4 query / 2 KV heads, tied embeddings) with a byte-level
  tokenizer built here from the ``tokenizers`` library: 256 byte tokens (id = byte value) plus
  ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` and a ChatML chat template. Random init from
  ``seed`` only, so every replica builds bit-identical weights; nothing is downloaded.
* anything else: ``AutoModelForCausalLM.from_pretrained`` / ``AutoTokenizer.from_pretrained``
  (Hub name or local directory, with its own tokenizer and chat template); a missing pad token is
  set to the EOS token.

Both honour ``model.attn_implementation`` (SDPA by default), ``model.precision`` / ``model.dtype``
(the parameters are float32, or bfloat16 for precision ``"bf16"``; :func:`autocast` gives the bf16
autocast context of ``"bf16-autocast"``) and ``model.gradient_checkpointing``; the KV cache is
switched off for training (``config.use_cache``, restored by :func:`for_inference` before saving).
:func:`compile_model` applies ``model.compile`` (``torch.compile`` in place, so parameter names,
``state_dict`` and ``save_pretrained`` are unchanged).

Both round-trip through ``save_pretrained`` / ``from_pretrained`` (safetensors), which is how
``<run>/final/`` is written (:func:`upload_pretrained`) and read back (:func:`download_pretrained`).

Failure: a named model that cannot be loaded raises ``ModelLoadError`` naming the model and the fix
(network, name, revision or ``trust_remote_code``); so does an attention implementation or gradient
checkpointing that the model does not support.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from diloco_serverless.config import ModelConfig
from diloco_serverless.errors import UserInputError

__all__ = [
    "TINY_PRESET",
    "ModelLoadError",
    "build_model",
    "autocast",
    "compile_model",
    "for_inference",
    "build_byte_tokenizer",
    "tiny_config",
    "count_parameters",
    "torch_dtype",
    "upload_pretrained",
    "download_pretrained",
]

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>")

# ChatML, as Qwen2 uses; `add_generation_prompt` opens the assistant turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TINY_PRESET: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}


class ModelLoadError(UserInputError, RuntimeError):
    """A named model or tokenizer could not be loaded; the message names it and what to check."""


def torch_dtype(name: str) -> torch.dtype:
    """``"float32"`` / ``"bfloat16"`` -> the torch dtype; ValueError otherwise."""
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if name not in table:
        raise ValueError(f"model.dtype must be one of {sorted(table)}, got {name!r}")
    return table[name]


def _gpt2_bytes_to_unicode() -> list[str]:
    """GPT-2's reversible byte -> printable-unicode map (Radford et al. 2019), by byte value."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    table: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def build_byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level fast tokenizer: token id = byte value (0..255), then the special tokens.

    Lossless on any UTF-8 text; saves as ``tokenizer.json`` and reloads with ``AutoTokenizer``.
    """
    vocab = {ch: i for i, ch in enumerate(_gpt2_bytes_to_unicode())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]  # untyped in transformers
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        bos_token=None,
        unk_token=None,
        model_max_length=TINY_PRESET["max_position_embeddings"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(vocab_size: int, **overrides: Any) -> Qwen2Config:
    """The Qwen2 config of the ``tiny`` preset (about 1M parameters at a 259-token vocabulary)."""
    kwargs = {**TINY_PRESET, **overrides}
    return Qwen2Config(
        vocab_size=vocab_size,
        bos_token_id=None,
        eos_token_id=vocab_size - len(SPECIAL_TOKENS),
        pad_token_id=vocab_size - len(SPECIAL_TOKENS),
        use_sliding_window=False,
        **kwargs,
    )


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def _attn_error(cfg: ModelConfig, exc: Exception) -> ModelLoadError:
    return ModelLoadError(
        f"model {cfg.name!r} cannot use model.attn_implementation={cfg.attn_implementation!r}: "
        f"{str(exc).rstrip('.')}. Use \"sdpa\" (the default) or \"eager\", or install the kernel's package"
    )


def _build_tiny(cfg: ModelConfig, seed: int, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    tokenizer = build_byte_tokenizer()
    config = tiny_config(len(tokenizer))
    config._attn_implementation = cfg.attn_implementation
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = Qwen2ForCausalLM(config)
    except (ValueError, ImportError) as exc:
        raise _attn_error(cfg, exc) from exc
    return model.to(dtype), tokenizer  # type: ignore[arg-type]  # transformers wraps .to(); its stub takes the model


def _build_named(cfg: ModelConfig, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    kwargs: dict[str, Any] = {"revision": cfg.revision, "trust_remote_code": cfg.trust_remote_code}
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.name, **kwargs)
    except (OSError, ValueError, KeyError) as exc:
        raise _load_error(cfg, exc) from exc
    try:
        model = AutoModelForCausalLM.from_pretrained(
            cfg.name, dtype=dtype, attn_implementation=cfg.attn_implementation, **kwargs
        )
    except ImportError as exc:
        raise _attn_error(cfg, exc) from exc
    except (OSError, ValueError, KeyError) as exc:
        if "attn" in str(exc).lower() or "attention" in str(exc).lower():
            raise _attn_error(cfg, exc) from exc
        raise _load_error(cfg, exc) from exc
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelLoadError(f"tokenizer of {cfg.name!r} has neither a pad nor an EOS token; cannot pad batches")
        tokenizer.pad_token = tokenizer.eos_token
    return model.to(dtype), tokenizer  # type: ignore[arg-type]  # transformers wraps .to(); its stub takes the model


def _load_error(cfg: ModelConfig, exc: Exception) -> ModelLoadError:
    return ModelLoadError(
        f"cannot load model {cfg.name!r} (revision {cfg.revision!r}): {str(exc).rstrip('.')}. "
        "Check the name or local path, network access to the Hub (HF_TOKEN for gated models), "
        'or use model.name="tiny"'
    )


def build_model(cfg: ModelConfig, seed: int = 0) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Build ``(model, tokenizer)`` for ``cfg``; tiny models are random-initialised from ``seed``.

    The model is returned in train mode on the CPU with ``cfg.param_dtype`` parameters, the KV cache
    off and gradient checkpointing on when asked; move it with ``.to(device)``. Raises
    ModelLoadError for a named model that cannot be loaded, an attention implementation it cannot
    use, or gradient checkpointing it does not support.
    """
    dtype = torch_dtype(cfg.param_dtype)
    model, tokenizer = _build_tiny(cfg, seed, dtype) if cfg.name == "tiny" else _build_named(cfg, dtype)
    model._diloco_use_cache = model.config.use_cache  # for_inference() puts it back around save_pretrained
    model.config.use_cache = False  # training never reads a KV cache; building one costs time and memory
    if cfg.gradient_checkpointing:
        if not model.supports_gradient_checkpointing:
            raise ModelLoadError(
                f"model {cfg.name!r} ({type(model).__name__}) does not support gradient checkpointing; "
                "set model.gradient_checkpointing=false"
            )
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x names it so
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:  # pragma: no cover - older transformers
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)  # type: ignore[no-untyped-call]
    model.train()
    return model, tokenizer


def autocast(cfg: ModelConfig, device: torch.device | str) -> contextlib.AbstractContextManager[Any]:
    """The context forward and backward run in: bf16 autocast for precision ``"bf16-autocast"``
    (parameters, gradients and optimizer state stay fp32), nothing otherwise."""
    device = torch.device(device)
    if cfg.autocast:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def compile_model(model: torch.nn.Module, cfg: ModelConfig) -> torch.nn.Module:
    """``torch.compile`` ``model`` in place when ``cfg.compile`` (``nn.Module.compile``: the module,
    its parameters and their names stay the same objects); returns ``model``."""
    if cfg.compile:
        model.compile()
    return model


@contextlib.contextmanager
def for_inference(model: PreTrainedModel) -> Iterator[PreTrainedModel]:
    """Inside the block ``model.config.use_cache`` is what the model's config had before
    :func:`build_model` switched it off for training (normally True, for generation), e.g. around
    ``save_pretrained``; the training setting is put back after."""
    before = model.config.use_cache
    model.config.use_cache = getattr(model, "_diloco_use_cache", True)
    try:
        yield model
    finally:
        model.config.use_cache = before


def upload_pretrained(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, store: Any, prefix: str = "final",
    *, state_dict: dict[str, torch.Tensor] | None = None, digests: dict[str, str] | None = None,
) -> list[str]:
    """``save_pretrained`` (safetensors) model + tokenizer to a temp dir, then put every file under
    ``<store>/<prefix>/``. ``store`` is an ObjectStore; returns the keys written. ``state_dict``: the
    tensors to save instead of the model's own (the gathered whole model of a sharded one). ``digests``,
    when given, receives each written key's SHA-256 (hex), for the signed ``final/DONE.json``."""
    written: list[str] = []
    with tempfile.TemporaryDirectory(prefix="diloco-final-") as tmp:
        with for_inference(model):
            model.save_pretrained(tmp, safe_serialization=True,
                                  state_dict=dict(state_dict) if state_dict is not None else None)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        for path in sorted(Path(tmp).rglob("*")):
            if path.is_file():
                key = f"{prefix.rstrip('/')}/{path.relative_to(tmp).as_posix()}"
                data = path.read_bytes()
                store.put(key, data)
                written.append(key)
                if digests is not None:
                    digests[key] = hashlib.sha256(data).hexdigest()
    return written


def download_pretrained(store: Any, prefix: str, local_dir: str | os.PathLike[str]) -> Path:
    """Copy every object under ``<store>/<prefix>/`` into ``local_dir`` (for ``from_pretrained``).

    Raises FileNotFoundError naming the store URL when nothing is there.
    """
    prefix = prefix.rstrip("/") + "/"
    keys = [k for k in store.list(prefix)]
    if not keys:
        raise FileNotFoundError(f"no model under {store.url}/{prefix}; has the run finished?")
    out = Path(local_dir)
    for key, data in store.get_many(keys).items():
        target = out / key[len(prefix) :]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return out
