"""compose_loss on a real (tiny, random-init) transformers Qwen2: exactness, autocast, training."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from diloco_serverless.loss import compose_loss, sequence_logprobs

VOCAB, PAD = 64, 0


def tiny_qwen(seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False,
    )  # fmt: skip
    return Qwen2ForCausalLM(config)


def _pack(rows: list[tuple[list[int], list[int]]], length: int) -> dict[str, torch.Tensor]:
    """Right-pad (prompt, response) rows to ``length``: ids, attention mask, response mask."""
    ids = torch.full((len(rows), length), PAD)
    attn, resp = torch.zeros_like(ids), torch.zeros_like(ids)
    for b, (prompt, response) in enumerate(rows):
        n_p, n = len(prompt), len(prompt) + len(response)
        ids[b, :n] = torch.tensor(prompt + response)
        attn[b, :n] = 1
        resp[b, n_p:n] = 1
    return {"input_ids": ids, "attention_mask": attn, "response_mask": resp}


def make_batch(rows: int = 3, seed: int = 1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def toks(n: int) -> list[int]:
        return torch.randint(1, VOCAB, (n,), generator=gen).tolist()

    prompts = [toks(3 + b) for b in range(rows)]
    responses = [toks(4 + (b % 2)) for b in range(rows)]
    hints = [toks(3) for _ in range(rows)]
    batch = _pack(list(zip(prompts, responses)), 12)
    teacher = _pack([(p + h, r) for p, h, r in zip(prompts, hints, responses)], 16)
    chosen = _pack([(p, r) for p, r in zip(prompts, responses)], 12)
    rejected = _pack([(p, toks(5)) for p in prompts], 12)
    for prefix, part in (("ctx_teacher_", teacher), ("dpo_chosen_", chosen), ("dpo_rejected_", rejected)):
        batch.update({prefix + key: value for key, value in part.items()})
    return batch


def add_reference_logprobs(batch: dict[str, torch.Tensor], reference: torch.nn.Module) -> None:
    with torch.no_grad():
        for side in ("chosen", "rejected"):
            batch[f"dpo_{side}_ref_logprobs"] = sequence_logprobs(
                reference, *(batch[f"dpo_{side}_{k}"] for k in ("input_ids", "attention_mask", "response_mask"))
            )


@pytest.fixture(scope="module")
def model() -> Qwen2ForCausalLM:
    return tiny_qwen()


@pytest.fixture()
def batch(model: Qwen2ForCausalLM) -> dict[str, torch.Tensor]:
    out = make_batch()
    add_reference_logprobs(out, model)
    return out


def _count_forwards(model: torch.nn.Module) -> tuple[list[Any], Any]:
    calls: list[Any] = []
    handle = model.register_forward_hook(lambda _m, _a, out: calls.append(out.logits.dtype))
    return calls, handle


def test_zero_weights_equal_plain_response_masked_ce_bit_for_bit(model: Qwen2ForCausalLM, batch) -> None:  # type: ignore[no-untyped-def]
    labels = batch["input_ids"].masked_fill(batch["response_mask"] == 0, -100)
    with torch.no_grad():
        plain = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=labels).loss
        calls, handle = _count_forwards(model)
        try:
            out = compose_loss(model, batch, alpha_sdpo=0.0, beta_replay=0.0)
        finally:
            handle.remove()
    assert len(calls) == 1  # all channels' inputs are present, but only the student pass runs
    assert torch.equal(out.total, plain) and torch.equal(out.lm_ce, plain)
    assert out.sdpo_jsd.item() == 0.0 and out.trace_replay_dpo.item() == 0.0


def test_sequence_logprobs_matches_manual_sum(model: Qwen2ForCausalLM, batch) -> None:  # type: ignore[no-untyped-def]
    ids, attn, resp = (batch[f"dpo_rejected_{k}"] for k in ("input_ids", "attention_mask", "response_mask"))
    with torch.no_grad():
        logp = model(input_ids=ids, attention_mask=attn).logits.float().log_softmax(-1)
    token_lp = logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    expected = (token_lp * resp[:, 1:]).sum(-1)
    torch.testing.assert_close(batch["dpo_rejected_ref_logprobs"], expected)
    assert not batch["dpo_rejected_ref_logprobs"].requires_grad


def test_dpo_against_itself_as_reference_is_log2(model: Qwen2ForCausalLM, batch) -> None:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        out = compose_loss(model, batch, beta_replay=1.0, dpo_beta=0.5)
    assert out.trace_replay_dpo.item() == pytest.approx(torch.log(torch.tensor(2.0)).item(), abs=1e-5)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"alpha_sdpo": 1.0},
        {"alpha_sdpo": 1.0, "sdpo_wrapper": "taid", "taid_t": 0.5},
        {"alpha_sdpo": 1.0, "sdpo_wrapper": "entropy_opd"},
        {"beta_replay": 1.0},
        {"beta_replay": 1.0, "dpo_variant": "simpo"},
    ],
    ids=["jsd", "taid", "entropy_opd", "dpo", "simpo"],
)
def test_every_live_channel_reaches_the_parameters(model: Qwen2ForCausalLM, batch, kwargs) -> None:  # type: ignore[no-untyped-def]
    out = compose_loss(model, batch, **kwargs)
    channel = out.sdpo_jsd if "alpha_sdpo" in kwargs else out.trace_replay_dpo
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(channel, params, allow_unused=True)
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    nonzero = sum(int(g.abs().sum() > 0) for g in grads)  # type: ignore[union-attr]
    assert nonzero >= len(params) - 1, f"only {nonzero}/{len(params)} parameters got a gradient"


def test_bf16_autocast_runs_the_loss_math_in_fp32(model: Qwen2ForCausalLM, batch) -> None:  # type: ignore[no-untyped-def]
    kwargs = {"alpha_sdpo": 0.5, "beta_replay": 0.5, "sdpo_wrapper": "entropy_opd"}
    reference = compose_loss(model, batch, **kwargs)
    calls, handle = _count_forwards(model)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = compose_loss(model, batch, **kwargs)
    finally:
        handle.remove()
    assert calls == [torch.bfloat16] * 3  # the forwards ran in bf16 ...
    for name in ("total", "lm_ce", "sdpo_jsd", "trace_replay_dpo"):
        value, ref = getattr(out, name), getattr(reference, name)
        assert value.dtype == torch.float32 and torch.isfinite(value), name  # ... the loss math in fp32
        assert value.item() == pytest.approx(ref.item(), rel=0.05, abs=0.02), name
    out.total.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    model.zero_grad(set_to_none=True)


def test_bf16_weights_give_fp32_components(batch) -> None:  # type: ignore[no-untyped-def]
    model = tiny_qwen().to(torch.bfloat16)
    out = compose_loss(model, batch, alpha_sdpo=1.0, beta_replay=1.0, sdpo_wrapper="taid", taid_t=0.6)
    assert all(getattr(out, n).dtype == torch.float32 for n in ("total", "lm_ce", "sdpo_jsd", "trace_replay_dpo"))
    assert torch.isfinite(out.total)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"sdpo_wrapper": "none", "dpo_variant": "dpo"},
        {"sdpo_wrapper": "taid", "taid_t": 0.7, "dpo_variant": "simpo"},
        {"sdpo_wrapper": "entropy_opd", "dpo_variant": "dpo"},
    ],
    ids=["jsd+dpo", "taid+simpo", "entropy_opd+dpo"],
)
def test_five_adamw_steps_with_all_channels_live_lower_the_total(kwargs: dict[str, Any]) -> None:
    model = tiny_qwen(seed=3)
    batch = make_batch(rows=4, seed=5)
    add_reference_logprobs(batch, copy.deepcopy(model).eval())
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    totals = []
    for _ in range(5):
        out = compose_loss(model, batch, alpha_sdpo=0.5, beta_replay=0.5, **kwargs)
        assert out.sdpo_jsd.item() > 0 and out.trace_replay_dpo.item() > 0
        opt.zero_grad(set_to_none=True)
        out.total.backward()
        opt.step()
        totals.append(out.total.item())
    print("totals", [round(t, 4) for t in totals])
    assert totals[-1] < totals[0] - 0.05
    assert totals == sorted(totals, reverse=True)
