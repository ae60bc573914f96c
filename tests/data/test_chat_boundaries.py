"""Chat rows whose tokenization merges across a turn boundary train, with exact assistant masks.

Real chat data (code above all) has assistant turns that start with a newline, spaces or a tab. A
byte-level BPE merges the template's ``"assistant\\n"`` with that whitespace and a SentencePiece-
style tokenizer makes pieces of whole boundaries, so the token ids of a rendered prefix are not a
prefix of the conversation's: comparing ids killed every replica on such a row. The tokenizers
here are trained in the test (``support/tiny_tokenizer.py``) on text full of such boundaries, and
each test first checks that the merge it is about really happens.

The check of a mask is exact and independent of the code under test: the ids are those of
tokenizing the whole rendered text, each maximal run of masked ids decodes to one assistant turn's
content and end-of-turn (preceded by at most the tail of the generation prompt that a straddling
token carries), and the unmasked ids hold the other turns.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_records import chat_rows, write_split

from diloco_serverless.config import RunConfig
from diloco_serverless.data.bad_rows import BadRows, min_rows
from diloco_serverless.data.builder import BatchBuilder
from diloco_serverless.data.examples import DataError, Example
from diloco_serverless.data.formats import Conversation, Encoder
from diloco_serverless.loss import compose_loss
from support.tiny_tokenizer import build_boundary_bpe, build_boundary_unigram

GEN_PROMPT = "<|im_start|>assistant\n"
END = "<|im_end|>\n"


@pytest.fixture(scope="module")
def boundary_bpe() -> Any:
    return build_boundary_bpe()


@pytest.fixture(scope="module")
def boundary_unigram() -> Any:
    return build_boundary_unigram()


@pytest.fixture(params=["bpe", "unigram"])
def tok(request: pytest.FixtureRequest, boundary_bpe: Any, boundary_unigram: Any) -> Any:
    return boundary_bpe if request.param == "bpe" else boundary_unigram


def _decode(tok: Any, ids: list[int]) -> str:
    return str(tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))


def _messages(turns: Conversation) -> list[dict[str, str]]:
    return [{"role": r, "content": c} for r, c in turns]


def _runs(mask: list[int]) -> list[tuple[int, int]]:
    runs, start = [], None
    for k, on in enumerate([*mask, 0]):
        if on and start is None:
            start = k
        elif not on and start is not None:
            runs.append((start, k))
            start = None
    return runs


def _check_exact(tok: Any, turns: Conversation, ex: Example, *, same_ids: bool = True) -> None:
    msgs = _messages(turns)
    last = max(i for i, (role, _) in enumerate(turns) if role == "assistant")
    text = tok.apply_chat_template(msgs[: last + 1], tokenize=False)
    ids = ex.prompt + ex.response
    assert _decode(tok, ids) == text
    if same_ids:  # exactly the ids apply_chat_template(tokenize=True) gives, as inference sees them
        assert ids == list(tok(text, add_special_tokens=False)["input_ids"])
    mask = ex.loss_mask if ex.loss_mask is not None else [1] * len(ex.response)
    assert len(mask) == len(ex.response) and mask[0] == 1 and mask[-1] == 1
    answers = [content for role, content in turns[: last + 1] if role == "assistant"]
    runs = _runs(mask)
    assert len(runs) == len(answers)
    for (a, b), content in zip(runs, answers, strict=True):
        run = _decode(tok, ex.response[a:b])
        assert run.endswith(content + END), (run, content)
        assert GEN_PROMPT.endswith(run[: len(run) - len(content + END)])
    unmasked = _decode(tok, ex.prompt) + "".join(
        _decode(tok, ex.response[b:a]) for (_, b), (a, _) in zip(runs, runs[1:], strict=False)
    )
    for role, content in turns[: last + 1]:
        if role != "assistant":
            assert content in unmasked


BOUNDARY_CASES: list[Conversation] = [
    (("user", "hi"), ("assistant", "  model data")),
    (("user", "write code"), ("assistant", "\n    the model learns")),
    (("user", "tab"), ("assistant", "\tthe\n\tdata")),
    (("user", "blank line"), ("assistant", "\n\nanswer")),
    (("system", "Be brief."), ("user", "a"), ("assistant", " one"), ("user", "\n b"), ("assistant", "\n\ttwo"),
     ("user", "c"), ("assistant", "  three\n")),
    (("user", "q"), ("assistant", "plain answer"), ("user", "trailing user turn")),
]


@pytest.mark.parametrize("turns", BOUNDARY_CASES, ids=[f"case{i}" for i in range(len(BOUNDARY_CASES))])
def test_masks_are_exact_when_merges_cross_the_turn_boundary(tok: Any, turns: Conversation) -> None:
    ex = Encoder(tok, hint_len=16).chat(turns, None, "row 0")
    _check_exact(tok, turns, ex)


def test_the_tokenizers_really_merge_across_the_boundary(boundary_bpe: Any, boundary_unigram: Any) -> None:
    """The premise of this file: the generation prompt's ids are not a prefix of the whole's."""
    msgs = _messages(BOUNDARY_CASES[0])
    for tok in (boundary_bpe, boundary_unigram):
        prompt = list(tok(tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False)["input_ids"])
        whole = list(tok(tok.apply_chat_template(msgs, tokenize=False), add_special_tokens=False)["input_ids"])
        assert whole[: len(prompt)] != prompt


def test_the_hint_teacher_reads_the_same_response(boundary_bpe: Any) -> None:
    turns = BOUNDARY_CASES[4]
    ex = Encoder(boundary_bpe, hint_len=16).chat(turns, "count to three", "row 0")
    _check_exact(boundary_bpe, turns, ex)
    assert ex.teacher_prompt != ex.prompt and "count to three" in _decode(boundary_bpe, ex.teacher_prompt)


class _NoOffsets:
    """A tokenizer without offsets (a Python / SentencePiece backend): not fast, refuses offsets."""

    is_fast = False

    def __init__(self, tok: Any) -> None:
        self._tok = tok

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)

    def __call__(self, text: str, **kw: Any) -> Any:
        if kw.get("return_offsets_mapping"):
            raise NotImplementedError("return_offset_mapping is not available when using Python tokenizers")
        return self._tok(text, **kw)


@pytest.mark.parametrize("turns", BOUNDARY_CASES[:5], ids=[f"case{i}" for i in range(5)])
def test_tokenizers_without_offsets_tokenize_turns_apart_with_an_exact_mask(tok: Any, turns: Conversation) -> None:
    slow = _NoOffsets(tok)
    ex = Encoder(slow, hint_len=16).chat(turns, None, "row 0")
    _check_exact(tok, turns, ex, same_ids=False)
    for (a, _), content in zip(_runs(ex.loss_mask or []), [c for r, c in turns if r == "assistant"], strict=False):
        assert _decode(tok, ex.response[a:]).startswith(content)  # cut exactly at the turn's first character


@pytest.mark.parametrize("response", ["  model data", "\n\tthe data", "\n\nanswer"])
def test_prompt_response_keeps_the_end_of_turn_when_the_answer_starts_with_whitespace(
    tok: Any, response: str
) -> None:
    """A pair's prompt is the generation prompt's ids (shared by chosen and rejected); the answer is
    the rest of the rendered text tokenized after it: its content and the template's end-of-turn."""
    prompt, answer = Encoder(tok, hint_len=8).pair("hi", response)
    msgs = [{"role": "user", "content": "hi"}]
    gen = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert prompt == list(tok(gen, add_special_tokens=False)["input_ids"])
    assert _decode(tok, answer) == response + END


def test_a_template_that_raises_is_an_unusable_row_not_a_crash(boundary_bpe: Any) -> None:
    tok = build_boundary_bpe()
    tok.chat_template = "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
    with pytest.raises(DataError, match=r"row 7: the chat template cannot render .*must alternate"):
        Encoder(tok, hint_len=8).chat((("user", "a"), ("assistant", "b")), None, "row 7")


# ---------------------------------------------------------------------------------- rows in a run
def _cfg(source: Path, *overrides: str) -> RunConfig:
    base = [f'data.source="{source}"', "data.format=chat", "loss.beta_replay=0", "data.columns.hint=answer",
            "data.seq_len=64", "data.batch_size=4", "data.hint_len=8", "data.prefetch=0", "data.eval_fraction=0.01",
            "replicas=1"]
    return RunConfig.load(None, [*base, *overrides])


def _whitespace_rows(n: int) -> list[dict[str, Any]]:
    rows = chat_rows(n)
    for i, row in enumerate(rows):
        for msg in row["messages"]:
            if msg["role"] == "assistant":
                msg["content"] = ("\n", "  ", "\t", "\n    ")[i % 4] + msg["content"]
    return rows


@pytest.mark.usefixtures("hf_offline")
def test_the_row_that_killed_every_replica_now_trains(tmp_path: Path, boundary_bpe: Any) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    write_split(tmp_path / "d", "train", _whitespace_rows(24), "jsonl")
    builder = BatchBuilder.from_config(_cfg(tmp_path / "d"), boundary_bpe, rank=0)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(boundary_bpe), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256, use_sliding_window=False,
    ))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        batch = builder.next_batch()
        assert int(batch["response_mask"].sum()) > 0 and int(batch["ctx_teacher_response_mask"].sum()) > 0
        loss = compose_loss(model, batch).total
        assert torch.isfinite(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert builder.bad_rows == 0


@pytest.mark.usefixtures("hf_offline")
def test_a_corrupt_row_is_skipped_counted_and_named(
    tmp_path: Path, boundary_bpe: Any, caplog: pytest.LogCaptureFixture
) -> None:
    rows = _whitespace_rows(40)
    rows[5]["messages"][2]["content"] = 17  # a wrong type in one assistant turn
    write_split(tmp_path / "d", "train", rows, "jsonl")
    # 1 row in 40 is 2.5%: within a limit of 5%
    builder = BatchBuilder.from_config(_cfg(tmp_path / "d", "data.max_bad_fraction=0.05"), boundary_bpe, rank=0)
    with caplog.at_level(logging.WARNING, logger="diloco_serverless.data.bad_rows"):
        for _ in range(20):  # 80 examples: two passes over the 40 rows
            builder.next_batch()
    assert builder.bad_rows == 2  # the same row, once per pass
    named = [r.getMessage() for r in caplog.records if "row 5: column 'messages' message 2" in r.getMessage()]
    assert named and "skipping an unusable row" in named[0]


@pytest.mark.usefixtures("hf_offline")
def test_more_bad_rows_than_max_bad_fraction_stop_with_examples(tmp_path: Path, boundary_bpe: Any) -> None:
    rows = _whitespace_rows(20)
    for i in (3, 11):
        rows[i]["messages"] = [{"role": "user", "content": "no answer"}]
    write_split(tmp_path / "d", "train", rows, "jsonl")
    lenient = BatchBuilder.from_config(_cfg(tmp_path / "d", "data.max_bad_fraction=0.2"), boundary_bpe, rank=0)
    for _ in range(12):
        lenient.next_batch()
    assert lenient.bad_rows >= 2
    strict = BatchBuilder.from_config(_cfg(tmp_path / "d"), boundary_bpe, rank=0)
    with pytest.raises(DataError, match=r"of \d+ rows read are unusable, more than data.max_bad_fraction=0.01; .*"
                                         r"Examples: .*row (3|11): column 'messages' has no assistant turn") as info:
        for _ in range(12):
            strict.next_batch()
    assert "\n" not in str(info.value)
    zero = BatchBuilder.from_config(_cfg(tmp_path / "d", "data.max_bad_fraction=0"), boundary_bpe, rank=0)
    with pytest.raises(DataError, match=r"1 of \d+ rows read are unusable"):
        for _ in range(6):
            zero.next_batch()


def test_bad_rows_judge_a_mostly_broken_source_early_and_a_few_bad_rows_late() -> None:
    assert min_rows(0.01) == 1000 and min_rows(0) == 0
    err = DataError("src row 1: broken")
    few = BadRows(0.01, "src")
    for i in range(2000):
        few.skip(err, pass_done=False) if i % 200 == 0 else few.good()  # 0.5%: trains
    assert few.bad == 10
    broken = BadRows(0.01, "src")
    with pytest.raises(DataError, match=r"11 of 11 rows read are unusable"):
        for _ in range(11):
            broken.skip(err, pass_done=False)  # 11 > 1% of the first 1,000 rows: stops at once
    whole_pass = BadRows(0.01, "src")
    for _ in range(50):
        whole_pass.good()
    with pytest.raises(DataError, match=r"1 of 51 rows"):
        whole_pass.skip(err, pass_done=True)  # after a whole pass the fraction is known
