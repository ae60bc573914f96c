"""compose_loss on the inner loop's hot path: the chosen side reuses the student's logits when it is the
student sequence, no tensor value is read without ``validate``, and micro-batch shares add up."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_loss_compose import _W, Bigram, V, _nls, make_batch, ref_lm_ce, ref_seq_logprobs

from diloco_serverless.loss import compose, compose_loss, scored_tokens
from support.host_reads import HostReads


class ShapeBigram(Bigram):
    """A Bigram that also records the shape of every forward's input ids."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self.shapes: list[tuple[int, ...]] = []

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
        self.shapes.append(tuple(input_ids.shape))
        return super().forward(input_ids, attention_mask)


def chosen_is_student() -> dict[str, torch.Tensor]:
    """make_batch() with every pair's chosen side = the student row (no preference pair of its own,
    as the stdlib data) and a rejected side of the same length."""
    batch = make_batch()
    for key in ("input_ids", "attention_mask", "response_mask"):
        batch[f"dpo_chosen_{key}"] = batch[key].clone()
    batch["dpo_rejected_input_ids"] = torch.tensor([[1, 2, 5, 3, 4, 0], [2, 6, 3, 7, 0, 0]])
    batch["dpo_rejected_attention_mask"] = batch["attention_mask"].clone()
    batch["dpo_rejected_response_mask"] = batch["response_mask"].clone()
    return batch


def test_chosen_equal_to_student_reuses_the_student_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    """One forward fewer: the pair pass runs the rejected rows only (2 rows instead of 4); the loss is
    the hand reference and its gradient the one of the full pair pass."""
    batch = chosen_is_student()
    model = ShapeBigram()
    out = compose_loss(model, batch, alpha_sdpo=1.0, beta_replay=0.5, dpo_beta=0.3)
    assert model.calls == [True, False, True]
    assert model.shapes == [(2, 6), (2, 7), (2, 6)], "student, teacher, rejected only"
    W = _W(model)
    lp_c = ref_seq_logprobs(W, batch["input_ids"], batch["response_mask"])
    lp_r = ref_seq_logprobs(W, batch["dpo_rejected_input_ids"], batch["dpo_rejected_response_mask"])
    ref_c, ref_r = batch["dpo_chosen_ref_logprobs"].tolist(), batch["dpo_rejected_ref_logprobs"].tolist()
    expected = sum(_nls(0.3 * ((c - rc) - (r - rr))) for c, r, rc, rr in zip(lp_c, lp_r, ref_c, ref_r)) / 2
    assert out.trace_replay_dpo.item() == pytest.approx(expected, rel=1e-6)
    (grad,) = torch.autograd.grad(out.total, model.table)

    monkeypatch.setattr(compose, "_same_sequences", lambda a, b: False)  # the full pair pass
    full_model = ShapeBigram()
    full = compose_loss(full_model, batch, alpha_sdpo=1.0, beta_replay=0.5, dpo_beta=0.3)
    assert full_model.shapes == [(2, 6), (2, 7), (4, 6)]
    (full_grad,) = torch.autograd.grad(full.total, full_model.table)
    torch.testing.assert_close(out.total, full.total, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grad, full_grad, rtol=1e-5, atol=1e-7)


def test_a_real_pair_still_runs_both_sides() -> None:
    model = ShapeBigram()
    compose_loss(model, make_batch(), beta_replay=1.0)  # chosen rows differ from the student rows
    assert model.shapes == [(2, 6), (4, 4)]
    batch = chosen_is_student()
    batch["dpo_chosen_response_mask"] = batch["dpo_chosen_response_mask"].clone()
    batch["dpo_chosen_response_mask"][1, 3] = 0  # same ids, other response: not the student sequence
    model = ShapeBigram()
    compose_loss(model, batch, beta_replay=1.0)
    assert model.shapes == [(2, 6), (4, 6)]


@pytest.mark.parametrize(
    ("kwargs", "validate", "reads"),
    [
        ({}, False, 0),
        ({}, True, 1),
        ({"alpha_sdpo": 1.0}, False, 0),
        ({"alpha_sdpo": 1.0, "beta_replay": 1.0}, False, 1),  # is the chosen side the student's?
        ({"alpha_sdpo": 1.0, "beta_replay": 1.0}, True, 2),  # + every value check, in one read
        ({"alpha_sdpo": 1.0, "sdpo_wrapper": "taid", "taid_t": 0.5}, False, 0),
        ({"alpha_sdpo": 1.0, "sdpo_wrapper": "entropy_opd", "beta_replay": 1.0, "dpo_variant": "simpo"}, False, 1),
    ],
)
def test_reads_of_tensor_values(kwargs: dict[str, Any], validate: bool, reads: int) -> None:
    """Before: about 14 reads per call with all channels (int(counts.sum()), bool(any()), boolean-mask
    indexing, isfinite of the reference log-probs), each a host-device sync on a GPU."""
    with HostReads() as counter:
        out = compose_loss(Bigram(), chosen_is_student(), validate=validate, **kwargs)
    assert len(counter) == reads, counter.sites
    assert torch.isfinite(out.total)


def test_validation_in_one_read_still_names_the_problem() -> None:
    batch = chosen_is_student()
    batch["dpo_rejected_response_mask"] = torch.tensor([[0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0]])
    with pytest.raises(ValueError, match=r"'dpo_rejected_response_mask'.*row 1"):
        compose_loss(Bigram(), batch, beta_replay=1.0)
    compose_loss(Bigram(), batch, beta_replay=1.0, dpo_variant="dpo", validate=False)  # not checked
    with pytest.raises(ValueError, match=r"'response_mask' has shape"):  # shapes are checked always
        compose_loss(Bigram(), dict(batch, response_mask=torch.ones(2, 5)), validate=False)


def test_micro_batch_shares_add_up_to_the_whole_batch() -> None:
    """token_count / pair_count: the two one-row halves' losses and gradients sum to the batch's
    (rows score 3 and 2 response tokens, so plain per-half means would weigh them wrongly)."""
    batch = make_batch()
    kw: dict[str, Any] = {"alpha_sdpo": 0.7, "beta_replay": 0.5}
    model = Bigram()
    whole = compose_loss(model, batch, **kw)
    (whole_grad,) = torch.autograd.grad(whole.total, model.table)
    tokens = scored_tokens(batch)
    assert int(tokens) == 5
    parts = [{k: v[i : i + 1] for k, v in batch.items()} for i in range(2)]
    halves = [compose_loss(model, p, token_count=tokens, pair_count=2.0, **kw) for p in parts]
    for name in ("total", "lm_ce", "sdpo_jsd", "trace_replay_dpo"):
        torch.testing.assert_close(sum(getattr(h, name) for h in halves), getattr(whole, name))
    grads = [torch.autograd.grad(h.total, model.table)[0] for h in halves]
    torch.testing.assert_close(grads[0] + grads[1], whole_grad)
    naive = [compose_loss(model, p, **kw) for p in parts]
    assert abs(float(sum(n.lm_ce.detach() for n in naive) / 2 - whole.lm_ce.detach())) > 1e-3, "weights matter here"
    assert whole.lm_ce.item() == pytest.approx(ref_lm_ce(_W(model), batch), rel=1e-6)
    assert V == 8


def test_aligned_teacher_logits_match_boolean_indexing() -> None:
    """The sync-free alignment pairs the k-th scored teacher position with the k-th scored student
    position of each row, as boolean-mask indexing of both did, for scattered masks too."""
    from diloco_serverless.loss.logprobs import aligned_logits, scored_logits

    gen = torch.Generator().manual_seed(0)
    rows, s_len, t_len, vocab = 5, 9, 13, 6
    student = torch.zeros(rows, s_len - 1, dtype=torch.bool)
    teacher = torch.zeros(rows, t_len - 1, dtype=torch.bool)
    for r in range(rows):
        n = int(torch.randint(1, s_len - 1, (1,), generator=gen))
        student[r, torch.randperm(s_len - 1, generator=gen)[:n]] = True
        teacher[r, torch.randperm(t_len - 1, generator=gen)[:n]] = True
    logits = torch.randn(rows, t_len, vocab, generator=gen)
    aligned = aligned_logits(logits, teacher, student)
    assert aligned.shape == (rows, s_len - 1, vocab)
    torch.testing.assert_close(aligned[student], scored_logits(logits, teacher), rtol=0, atol=0)
