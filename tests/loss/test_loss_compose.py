"""compose_loss wiring: hand-computed channel references, auto-disable, forward counts, validation.

The model here is a bigram table (logits of position t = W[token t]) so that every expected value
can be written out with plain Python arithmetic; tests with a real transformers model live in
test_loss_qwen.py.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from diloco_serverless.loss import (
    LossComponents,
    TAIDScheduler,
    compose_loss,
    sequence_logprobs,
)

V = 8


class Bigram(nn.Module):
    """logits[b, t] = W[input_ids[b, t]]; records whether grad was enabled on each forward call."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.table = nn.Parameter(torch.randn(V, V, generator=gen))
        self.calls: list[bool] = []

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
        self.calls.append(torch.is_grad_enabled())
        return SimpleNamespace(logits=self.table[input_ids])


def _t(rows: list[list[int]]) -> torch.Tensor:
    return torch.tensor(rows)


def make_batch() -> dict[str, torch.Tensor]:
    """Two rows; the teacher context inserts a hint token; chosen/rejected pairs of length 4."""
    return {
        "input_ids": _t([[1, 2, 3, 4, 5, 0], [2, 6, 7, 3, 0, 0]]),
        "attention_mask": _t([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]]),
        "response_mask": _t([[0, 0, 1, 1, 1, 0], [0, 0, 1, 1, 0, 0]]),
        "ctx_teacher_input_ids": _t([[1, 2, 6, 6, 3, 4, 5], [2, 6, 1, 7, 3, 0, 0]]),
        "ctx_teacher_attention_mask": _t([[1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0]]),
        "ctx_teacher_response_mask": _t([[0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 0, 0]]),
        "dpo_chosen_input_ids": _t([[1, 2, 3, 4], [5, 6, 7, 0]]),
        "dpo_chosen_attention_mask": _t([[1, 1, 1, 1], [1, 1, 1, 0]]),
        "dpo_chosen_response_mask": _t([[0, 0, 1, 1], [0, 1, 1, 0]]),
        "dpo_rejected_input_ids": _t([[1, 2, 5, 5], [5, 6, 1, 2]]),
        "dpo_rejected_attention_mask": _t([[1, 1, 1, 1], [1, 1, 1, 1]]),
        "dpo_rejected_response_mask": _t([[0, 0, 1, 1], [0, 1, 1, 1]]),
        "dpo_chosen_ref_logprobs": torch.tensor([-3.0, -4.0]),
        "dpo_rejected_ref_logprobs": torch.tensor([-3.5, -2.0]),
    }


# ---- plain-Python references -------------------------------------------------------------------


def _log_softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    lse = m + math.log(sum(math.exp(x - m) for x in xs))
    return [x - lse for x in xs]


def _scored(ids: torch.Tensor, resp: torch.Tensor) -> list[list[tuple[int, int]]]:
    """Per row: (previous token, target token) for every scored response position."""
    return [
        [(int(ids[b, t - 1]), int(ids[b, t])) for t in range(1, ids.shape[1]) if resp[b, t]]
        for b in range(ids.shape[0])
    ]


def _kl(lp: list[float], lq: list[float]) -> float:
    return sum(math.exp(a) * (a - b) for a, b in zip(lp, lq))


def ref_lm_ce(W: list[list[float]], batch: dict[str, torch.Tensor]) -> float:
    pairs = [p for row in _scored(batch["input_ids"], batch["response_mask"]) for p in row]
    return -sum(_log_softmax(W[prev])[tok] for prev, tok in pairs) / len(pairs)


def ref_sdpo(W: list[list[float]], batch: dict[str, torch.Tensor], per_token) -> float:  # type: ignore[no-untyped-def]
    student = _scored(batch["input_ids"], batch["response_mask"])
    teacher = _scored(batch["ctx_teacher_input_ids"], batch["ctx_teacher_response_mask"])
    values = [
        per_token(W[s_prev], W[t_prev])
        for s_row, t_row in zip(student, teacher)
        for (s_prev, _), (t_prev, _) in zip(s_row, t_row, strict=True)
    ]
    return sum(values) / len(values)


def ref_seq_logprobs(W: list[list[float]], ids: torch.Tensor, resp: torch.Tensor) -> list[float]:
    return [sum(_log_softmax(W[prev])[tok] for prev, tok in row) for row in _scored(ids, resp)]


def _nls(x: float) -> float:
    return math.log1p(math.exp(-x)) if x > -30 else -x


def jsd_ref(beta: float):  # type: ignore[no-untyped-def]
    def per_token(s: list[float], t: list[float]) -> float:
        lq, lp = _log_softmax(s), _log_softmax(t)
        if beta == 0.0:
            return _kl(lp, lq)
        if beta == 1.0:
            return _kl(lq, lp)
        lm = [math.log(beta * math.exp(a) + (1 - beta) * math.exp(b)) for a, b in zip(lp, lq)]
        return beta * _kl(lp, lm) + (1 - beta) * _kl(lq, lm)

    return per_token


def taid_ref(t: float):  # type: ignore[no-untyped-def]
    def per_token(s: list[float], te: list[float]) -> float:
        target = [math.exp(v) for v in _log_softmax([(1 - t) * a + t * b for a, b in zip(s, te)])]
        return -sum(p * lq for p, lq in zip(target, _log_softmax(s)))

    return per_token


def opd_ref(h_max: float | None):  # type: ignore[no-untyped-def]
    def per_token(s: list[float], t: list[float]) -> float:
        lq, lp = _log_softmax(s), _log_softmax(t)
        h = -sum(math.exp(a) * a for a in lp)
        w = min(max(h / (h_max or math.log(V)), 0.0), 1.0)
        return w * _kl(lp, lq) + (1 - w) * _kl(lq, lp)

    return per_token


@pytest.fixture()
def model() -> Bigram:
    return Bigram()


def _W(model: Bigram) -> list[list[float]]:
    return model.table.detach().double().tolist()


# ---- channel references ------------------------------------------------------------------------


def test_lm_ce_matches_hand_reference(model: Bigram) -> None:
    batch = make_batch()
    out = compose_loss(model, batch)
    assert isinstance(out, LossComponents)
    assert out.lm_ce.item() == pytest.approx(ref_lm_ce(_W(model), batch), rel=1e-6)
    assert out.total is out.lm_ce


@pytest.mark.parametrize(
    ("kwargs", "per_token"),
    [
        ({"jsd_beta": 0.0}, jsd_ref(0.0)),
        ({"jsd_beta": 0.5}, jsd_ref(0.5)),
        ({"jsd_beta": 0.2}, jsd_ref(0.2)),
        ({"jsd_beta": 1.0}, jsd_ref(1.0)),
        ({"sdpo_wrapper": "taid", "taid_t": 0.3}, taid_ref(0.3)),
        ({"sdpo_wrapper": "taid", "taid_t": 1.0}, taid_ref(1.0)),
        ({"sdpo_wrapper": "entropy_opd"}, opd_ref(None)),
        ({"sdpo_wrapper": "entropy_opd", "entropy_opd_h_max": 1.0}, opd_ref(1.0)),
    ],
    ids=["jsd0", "jsd.5", "jsd.2", "jsd1", "taid.3", "taid1", "opd", "opd-hmax1"],
)
def test_sdpo_channel_matches_hand_reference(model: Bigram, kwargs: dict[str, Any], per_token) -> None:  # type: ignore[no-untyped-def]
    batch = make_batch()
    out = compose_loss(model, batch, alpha_sdpo=0.7, **kwargs)
    W = _W(model)
    expected = ref_sdpo(W, batch, per_token)
    assert out.sdpo_jsd.item() == pytest.approx(expected, rel=1e-5, abs=1e-7)
    assert out.total.item() == pytest.approx(ref_lm_ce(W, batch) + 0.7 * expected, rel=1e-5)
    assert out.trace_replay_dpo.item() == 0.0


def test_dpo_channel_matches_hand_reference(model: Bigram) -> None:
    batch = make_batch()
    out = compose_loss(model, batch, beta_replay=0.5, dpo_beta=0.3)
    W = _W(model)
    lp_c = ref_seq_logprobs(W, batch["dpo_chosen_input_ids"], batch["dpo_chosen_response_mask"])
    lp_r = ref_seq_logprobs(W, batch["dpo_rejected_input_ids"], batch["dpo_rejected_response_mask"])
    ref_c, ref_r = batch["dpo_chosen_ref_logprobs"].tolist(), batch["dpo_rejected_ref_logprobs"].tolist()
    expected = sum(_nls(0.3 * ((c - rc) - (r - rr))) for c, r, rc, rr in zip(lp_c, lp_r, ref_c, ref_r)) / 2
    assert out.trace_replay_dpo.item() == pytest.approx(expected, rel=1e-6)
    assert out.total.item() == pytest.approx(ref_lm_ce(W, batch) + 0.5 * expected, rel=1e-6)
    assert out.sdpo_jsd.item() == 0.0


def test_simpo_channel_matches_hand_reference(model: Bigram) -> None:
    batch = make_batch()
    out = compose_loss(model, batch, beta_replay=1.0, dpo_variant="simpo", simpo_beta=2.5, simpo_gamma=0.5)
    W = _W(model)
    lp_c = ref_seq_logprobs(W, batch["dpo_chosen_input_ids"], batch["dpo_chosen_response_mask"])
    lp_r = ref_seq_logprobs(W, batch["dpo_rejected_input_ids"], batch["dpo_rejected_response_mask"])
    n_c, n_r = [2, 2], [2, 3]  # scored response tokens per row
    expected = sum(_nls(2.5 * (c / nc - r / nr) - 0.5) for c, r, nc, nr in zip(lp_c, lp_r, n_c, n_r)) / 2
    assert out.trace_replay_dpo.item() == pytest.approx(expected, rel=1e-6)


def test_simpo_needs_no_reference_logprobs(model: Bigram) -> None:
    batch = make_batch()
    del batch["dpo_chosen_ref_logprobs"], batch["dpo_rejected_ref_logprobs"]
    out = compose_loss(model, batch, beta_replay=1.0, dpo_variant="simpo")
    assert out.trace_replay_dpo.item() > 0


def test_sequence_logprobs_matches_hand_reference(model: Bigram) -> None:
    batch = make_batch()
    ids, mask = batch["dpo_rejected_input_ids"], batch["dpo_rejected_response_mask"]
    with torch.no_grad():
        out = sequence_logprobs(model, ids, batch["dpo_rejected_attention_mask"], mask)
    assert out.shape == (2,) and out.dtype == torch.float32
    torch.testing.assert_close(out, torch.tensor(ref_seq_logprobs(_W(model), ids, mask)).float())
    with pytest.raises(ValueError, match=r"response_mask.*\(2, 3\).*\(2, 4\)"):
        sequence_logprobs(model, ids, batch["dpo_rejected_attention_mask"], mask[:, :3])


# ---- auto-disable and forward counts -----------------------------------------------------------


def test_all_channels_live_use_one_forward_each(model: Bigram) -> None:
    out = compose_loss(model, make_batch(), alpha_sdpo=1.0, beta_replay=1.0)
    # student (grad), hinted teacher (no grad), chosen+rejected in one batched pass (grad)
    assert model.calls == [True, False, True]
    assert all(x.item() > 0 for x in (out.lm_ce, out.sdpo_jsd, out.trace_replay_dpo))


def test_pairs_of_different_lengths_use_two_forwards(model: Bigram) -> None:
    batch = make_batch()
    for key in ("input_ids", "attention_mask", "response_mask"):
        batch[f"dpo_rejected_{key}"] = torch.cat([batch[f"dpo_rejected_{key}"], torch.zeros(2, 2, dtype=torch.long)], 1)
    padded = compose_loss(model, batch, beta_replay=1.0)
    assert model.calls == [True, True, True]
    unpadded = compose_loss(model, make_batch(), beta_replay=1.0)
    assert padded.trace_replay_dpo.item() == pytest.approx(unpadded.trace_replay_dpo.item())


def _absent_variants() -> list[tuple[str, Any]]:
    return [("missing", None), ("none", "none"), ("empty", "empty")]


@pytest.mark.parametrize(("name", "how"), _absent_variants())
def test_channels_with_absent_inputs_are_exact_zero_without_forward(model: Bigram, name: str, how: Any) -> None:
    batch = make_batch()
    reference = compose_loss(Bigram(), batch)
    for key in list(batch):
        if key.startswith(("ctx_teacher_", "dpo_")):
            if how is None:
                del batch[key]
            elif how == "none":
                batch[key] = None  # type: ignore[assignment]
            else:
                batch[key] = batch[key][:0]
    out = compose_loss(model, batch, alpha_sdpo=1.0, beta_replay=1.0)
    assert model.calls == [True]
    assert out.sdpo_jsd.item() == 0.0 and out.trace_replay_dpo.item() == 0.0
    assert out.sdpo_jsd.dtype == out.trace_replay_dpo.dtype == torch.float32
    assert torch.equal(out.total, reference.total)


def test_zero_weights_are_exact_zero_without_forward(model: Bigram) -> None:
    out = compose_loss(model, make_batch(), alpha_sdpo=0.0, beta_replay=0.0)
    assert model.calls == [True]
    assert out.total is out.lm_ce
    assert out.sdpo_jsd.item() == 0.0 and out.trace_replay_dpo.item() == 0.0


def test_taid_at_t0_skips_the_teacher_forward_and_has_zero_gradient(model: Bigram) -> None:
    out = compose_loss(model, make_batch(), alpha_sdpo=1.0, sdpo_wrapper="taid", taid_t=0.0)
    assert model.calls == [True]
    (grad,) = torch.autograd.grad(out.sdpo_jsd, model.table)
    torch.testing.assert_close(grad, torch.zeros_like(grad), atol=1e-7, rtol=0)


def test_taid_scheduler_drives_compose_loss(model: Bigram) -> None:
    sched = TAIDScheduler(num_train_steps=4, disable_adaptive=True)
    values = []
    for step in range(3):
        out = compose_loss(model, make_batch(), alpha_sdpo=1.0, sdpo_wrapper="taid", taid_t=sched.t)
        values.append(out.sdpo_jsd.item())
        sched.update_t(out.sdpo_jsd, step + 1)
    assert sched.t == pytest.approx(0.4 + 0.6 * 3 / 4)
    assert len(set(values)) == 3  # t changed the target each step


def test_live_channels_send_finite_gradients_to_the_model(model: Bigram) -> None:
    out = compose_loss(model, make_batch(), alpha_sdpo=1.0, beta_replay=1.0)
    for name in ("lm_ce", "sdpo_jsd", "trace_replay_dpo"):
        (grad,) = torch.autograd.grad(getattr(out, name), model.table, retain_graph=True)
        assert torch.isfinite(grad).all() and grad.abs().sum() > 0, name
    assert out.to_floats()["total"] == pytest.approx(out.total.item())


# ---- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dpo_variant": "ipo"}, "dpo_variant"),
        ({"sdpo_wrapper": "kd"}, "sdpo_wrapper"),
        ({"sdpo_wrapper": "taid"}, "taid_t"),
        ({"sdpo_wrapper": "taid", "taid_t": 1.5}, "taid_t"),
        ({"sdpo_wrapper": "taid", "taid_t": -0.1}, "taid_t"),
        ({"jsd_beta": 1.2}, "jsd_beta"),
        ({"alpha_sdpo": -1.0}, "alpha_sdpo"),
        ({"beta_replay": float("nan")}, "beta_replay"),
        ({"dpo_beta": 0.0}, "dpo_beta"),
        ({"simpo_beta": -2.0}, "simpo_beta"),
        ({"simpo_gamma": float("inf")}, "simpo_gamma"),
        ({"entropy_opd_h_max": 0.0}, "entropy_opd_h_max"),
    ],
)
def test_bad_kwargs_raise_even_when_the_channel_is_off(model: Bigram, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        compose_loss(model, make_batch(), **kwargs)
    assert model.calls == []


def test_unknown_kwarg_is_a_type_error(model: Bigram) -> None:
    with pytest.raises(TypeError):
        compose_loss(model, make_batch(), alpha_spdo=1.0)  # type: ignore[call-arg]


def _with(key: str, value: Any) -> dict[str, Any]:
    batch: dict[str, Any] = make_batch()
    batch[key] = value
    return batch


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("response_mask", torch.ones(2, 5, dtype=torch.long), r"'response_mask'.*\(2, 5\).*'input_ids'.*\(2, 6\)"),
        ("attention_mask", None, r"'attention_mask' is missing"),
        ("input_ids", torch.zeros(2, 6), r"'input_ids'.*integer.*float32"),
        ("input_ids", torch.zeros(6, dtype=torch.long), r"'input_ids'.*\[B, T\].*\(6,\)"),
        ("response_mask", torch.zeros(2, 6, dtype=torch.long), r"'response_mask'.*\(2, 6\).*no response token"),
        ("ctx_teacher_response_mask", torch.ones(2, 5), r"'ctx_teacher_response_mask'.*\(2, 5\)"),
        ("ctx_teacher_attention_mask", None, r"'ctx_teacher_attention_mask' is missing"),
        ("dpo_rejected_input_ids", None, r"'dpo_rejected_input_ids' is missing"),
        ("dpo_chosen_ref_logprobs", torch.zeros(2, 1), r"'dpo_chosen_ref_logprobs'.*\(2, 1\).*\(2,\)"),
        ("dpo_rejected_ref_logprobs", None, r"'dpo_rejected_ref_logprobs' is missing"),
        ("dpo_chosen_ref_logprobs", torch.tensor([0.0, float("nan")]), r"'dpo_chosen_ref_logprobs'.*non-finite"),
        ("dpo_chosen_response_mask", _t([[0, 0, 1, 1], [1, 0, 0, 0]]), r"'dpo_chosen_response_mask'.*row 1"),
    ],
)
def test_bad_batches_raise_value_errors_naming_key_and_shape(model: Bigram, key: str, value: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        compose_loss(model, _with(key, value), alpha_sdpo=1.0, beta_replay=1.0)


def test_teacher_with_other_row_count_is_named(model: Bigram) -> None:
    batch = make_batch()
    for key in ("input_ids", "attention_mask", "response_mask"):
        batch[f"ctx_teacher_{key}"] = torch.cat([batch[f"ctx_teacher_{key}"]] * 2)
    with pytest.raises(
        ValueError, match=r"'input_ids' \(shape \(2, 6\)\) and 'ctx_teacher_input_ids' \(shape \(4, 7\)\)"
    ):
        compose_loss(model, batch, alpha_sdpo=1.0)


def test_teacher_row_with_other_token_count_is_named(model: Bigram) -> None:
    batch = make_batch()
    batch["ctx_teacher_response_mask"] = _t([[0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 1, 0]])
    with pytest.raises(ValueError, match=r"row 1: 'response_mask' scores 2 .* 'ctx_teacher_response_mask' scores 3"):
        compose_loss(model, batch, alpha_sdpo=1.0)


def test_non_tensor_batch_value_is_named(model: Bigram) -> None:
    with pytest.raises(ValueError, match="'input_ids' must be a torch.Tensor"):
        compose_loss(model, _with("input_ids", [[1, 2, 3]]))
