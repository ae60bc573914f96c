"""A tiny byte-level BPE tokenizer with a ChatML template, trained in the test (nothing downloads),
and the word list the synthetic records are made of. Shared by tests/data and tests/e2e."""

from __future__ import annotations

import random
from typing import Any

EOS = "<|endoftext|>"
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
WORDS = (
    "the a model learns data from every replica while object stores carry averaged pseudo gradients between "
    "rounds of inner steps and outer updates question answer add sum number colour blue red green because"
).split()


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


# ------------------------------------------------------------------------------------ the model
def build_tokenizer() -> Any:
    """A byte-level BPE (vocabulary 400) trained on a few KB, EOS = pad, ChatML chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    corpus = [sentence(rng, 12) + "." for _ in range(300)]
    corpus += [f"Add {i} and {i + 1}. The sum is {2 * i + 1}." for i in range(50)]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=[EOS, "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(corpus, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, pad_token=EOS)
    tok.chat_template = CHATML
    return tok


# ------------------------------------------------------------------ tokenizers that merge across turns
BOUNDARY_WHITESPACE = ("\n ", "\n  ", "\n    ", "\n\t", "\n\n", "\n\t\t", " \n")


def _boundary_corpus() -> list[str]:
    """Text where a role name or a turn's last newline is followed by whitespace, so the trained
    vocabulary has tokens that cross the template's turn boundary (``"\\n"`` + ``" "``)."""
    rng = random.Random(1)
    out = []
    for _ in range(400):
        ws = rng.choice(BOUNDARY_WHITESPACE)
        out.append("assistant" + ws + sentence(rng, 6) + "\n" + ws + sentence(rng, 3))
    return out


def build_boundary_bpe() -> Any:
    """A byte-level BPE (vocabulary 400, ChatML) whose merges include ``"\\n" + " "``, ``"\\n\\n"``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=[EOS, "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(_boundary_corpus(), trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token=EOS, pad_token=EOS)
    tok.chat_template = CHATML
    return tok


def build_boundary_unigram() -> Any:
    """A SentencePiece-style tokenizer (Unigram pieces over Metaspace ``▁``, not split at spaces, as
    sentencepiece does), ChatML; its pieces span whole boundaries (``"assistant\\n▁▁"``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    uni = Tokenizer(models.Unigram())
    uni.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=False)
    uni.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="never")
    trainer = trainers.UnigramTrainer(
        vocab_size=400, special_tokens=[EOS, "<|im_start|>", "<|im_end|>", "<unk>"], unk_token="<unk>",
        initial_alphabet=[chr(c) for c in range(33, 127)] + ["\n", "\t", "▁"],
    )
    uni.train_from_iterator(_boundary_corpus(), trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=uni, eos_token=EOS, pad_token=EOS, unk_token="<unk>")
    tok.chat_template = CHATML
    return tok
