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
