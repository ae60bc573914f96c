"""The transformers generation backend and rollout batches, on the tiny random Qwen2 (nothing downloads)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from diloco_serverless.config import ModelConfig
from diloco_serverless.data.prompts import PromptRecord
from diloco_serverless.loss import group_advantages
from diloco_serverless.rl.generation import SamplingSettings, TransformersBackend, completion_mask, left_pad
from diloco_serverless.rl.reward_calls import NamedReward, RewardError
from diloco_serverless.rl.rollouts import build_rollouts
from diloco_serverless.trainer.model import build_model


@pytest.fixture(scope="module")
def tiny() -> tuple[Any, Any]:
    return build_model(ModelConfig(), 0)


def _backend(tok: Any, **kw: Any) -> TransformersBackend:
    settings = SamplingSettings(**{"temperature": 0.7, "max_completion_length": 10, **kw})
    return TransformersBackend(settings, pad_id=tok.pad_token_id, eos_id=tok.eos_token_id)


def test_left_pad_and_completion_mask() -> None:
    ids, mask = left_pad([[5, 6, 7], [8]], 0, torch.device("cpu"))
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    comp = torch.tensor([[3, 9, 4, 9], [1, 2, 3, 4], [9, 9, 9, 9]])
    assert completion_mask(comp, 9).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]


def test_sampling_logprobs_are_the_forward_logprobs_at_the_temperature(tiny: tuple[Any, Any]) -> None:
    model, tok = tiny
    prompts = [tok("hello")["input_ids"], tok("a much longer prompt")["input_ids"]]
    gen = _backend(tok).generate(model, prompts, 3, seed=7)
    assert gen.prompt_ids.shape[0] == gen.completion_ids.shape[0] == 6
    assert gen.prompt_mask[0, 0] == 0 and gen.prompt_mask[:, -1].all()  # left-padded
    assert torch.equal(gen.prompt_ids[0], gen.prompt_ids[2]) and not torch.equal(gen.prompt_ids[0], gen.prompt_ids[3])
    ids = torch.cat([gen.prompt_ids, gen.completion_ids], 1)
    mask = torch.cat([gen.prompt_mask, gen.completion_mask], 1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float() / 0.7
    lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)[:, gen.prompt_ids.shape[1] - 1 :]
    torch.testing.assert_close(lp * gen.completion_mask, gen.sampling_logprobs, atol=1e-5, rtol=1e-5)
    assert model.training  # the backend puts the mode back


def test_same_seed_same_completions_and_global_rng_untouched(tiny: tuple[Any, Any]) -> None:
    model, tok = tiny
    prompts = [tok("hello")["input_ids"]]
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = _backend(tok).generate(model, prompts, 4, seed=1)
    assert torch.equal(torch.get_rng_state(), before)
    b = _backend(tok).generate(model, prompts, 4, seed=1)
    c = _backend(tok).generate(model, prompts, 4, seed=2)
    assert torch.equal(a.completion_ids, b.completion_ids) and not torch.equal(a.completion_ids, c.completion_ids)


def test_top_k_one_is_greedy_with_logprob_zero(tiny: tuple[Any, Any]) -> None:
    model, tok = tiny
    gen = _backend(tok, top_k=1).generate(model, [tok("hello")["input_ids"]], 2, seed=3)
    assert torch.equal(gen.completion_ids[0], gen.completion_ids[1])
    assert gen.sampling_logprobs.abs().max() < 1e-6


def _count_a(prompts: list[Any], completions: list[Any], **kw: Any) -> list[float | None]:
    return [float(c.count("a")) if i % 5 else None for i, c in enumerate(completions)]


def test_rollout_batch(tiny: tuple[Any, Any]) -> None:
    model, tok = tiny
    records = [
        PromptRecord("hello", tok("hello")["input_ids"], {"answer": "x"}),
        PromptRecord([{"role": "user", "content": "hi"}], tok("hi there")["input_ids"], {"answer": "y"}),
    ]
    seen: dict[str, Any] = {}

    def spy(prompts: list[Any], completions: list[Any], **kw: Any) -> list[float | None]:
        seen.update(kw, prompts=prompts, completions=completions)
        return [1.0] * len(completions)

    out = build_rollouts(
        model, _backend(tok), records, tokenizer=tok, num_generations=4,
        reward_funcs=[NamedReward("t:count_a", _count_a), NamedReward("t:spy", spy)], reward_weights=[2.0, 0.5],
        scale_rewards="group", max_completion_length=10, seed=0,
    )  # fmt: skip
    b = out.batch
    assert b["input_ids"].shape[0] == 8 and b["advantages"].shape == (8,)
    assert seen["answer"] == ["x"] * 4 + ["y"] * 4 and seen["prompts"][4] == records[1].prompt
    assert seen["completions"][4][0]["role"] == "assistant" and isinstance(seen["completions"][0], str)
    assert seen["max_completion_length"] == 10 and len(seen["completion_ids"]) == 8
    # row 0 and 5: count_a is None, spy still scores: weighted reward 0.5 (scorable)
    texts = [c if isinstance(c, str) else c[0]["content"] for c in out.completions]
    want_rewards = torch.tensor([2.0 * float(t.count("a")) if i % 5 else 0.0 for i, t in enumerate(texts)])
    torch.testing.assert_close(out.rewards, want_rewards + 0.5)
    torch.testing.assert_close(b["advantages"], group_advantages(out.rewards, 4))
    assert b["num_items_in_batch"].item() == b["response_mask"].sum().item()
    prompt_width = b["input_ids"].shape[1] - 10
    assert not b["response_mask"][:, :prompt_width].any()
    stats = out.stats(["t:count_a", "t:spy"])
    assert {"reward_mean", "reward/count_a/mean", "reward/spy/std", "completion_length", "generation_s"} <= set(stats)


def test_a_failing_reward_fails_the_rollouts(tiny: tuple[Any, Any]) -> None:
    model, tok = tiny

    def bad(prompts: list[Any], completions: list[Any], **kw: Any) -> list[float]:
        return [0.0]

    with pytest.raises(RewardError, match="reward function t:bad returned 1 rewards for 2 completions.*'hello'"):
        build_rollouts(
            model, _backend(tok), [PromptRecord("hello", tok("hello")["input_ids"])], tokenizer=tok,
            num_generations=2, reward_funcs=[NamedReward("t:bad", bad)], reward_weights=[1.0], scale_rewards="group",
            max_completion_length=10, seed=0,
        )  # fmt: skip
