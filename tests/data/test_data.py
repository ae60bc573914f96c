"""data.py: stdlib split and shards, the three compose_loss channels, JSONL records, determinism."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

from diloco_serverless.config import DataConfig, RunConfig
from diloco_serverless.data.builder import (
    DPO_KEYS,
    REF_KEYS,
    STUDENT_KEYS,
    TEACHER_KEYS,
    BatchBuilder,
    make_reference_model,
)
from diloco_serverless.data.examples import DataError
from diloco_serverless.data.jsonl import JsonlSource
from diloco_serverless.data.stdlib import (
    StdlibSource,
    list_corpus_files,
    split_train_eval,
    stdlib_root,
)
from diloco_serverless.loss import compose_loss, sequence_logprobs
from diloco_serverless.trainer.model import build_model


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Any:
    """Tiny matrices: one intra-op thread is faster and immune to a busy 2-core CI machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny() -> tuple[Any, Any]:
    return build_model(RunConfig().model, seed=0)


def _cfg(*overrides: str) -> RunConfig:
    return RunConfig.load(None, ["data.batch_size=4", *overrides])


def _builder(tiny: tuple[Any, Any], cfg: RunConfig, rank: int = 0, **kw: Any) -> BatchBuilder:
    model, tok = tiny
    ref = make_reference_model(model) if cfg.loss.needs_reference else None
    return BatchBuilder.from_config(cfg, tok, rank=rank, ref_model=ref, **kw)


def _decode(tok: Any, ids: torch.Tensor, mask: torch.Tensor) -> str:
    return tok.decode(ids[mask.bool()].tolist())


# ------------------------------------------------------------------ stdlib corpus
def test_stdlib_split_and_shards_are_disjoint_and_complete(tiny: tuple[Any, Any]) -> None:
    files = list(list_corpus_files(stdlib_root()))
    assert len(files) > 100 and all(f.endswith(".py") and "/test/" not in f"/{f}" for f in files)
    train, evals = split_train_eval(files, 0.05)
    assert set(train).isdisjoint(evals) and set(train) | set(evals) == set(files) and evals
    assert split_train_eval(list(reversed(files)), 0.05) == (train, evals)  # order-independent
    shards = [
        StdlibSource(tiny[1], DataConfig(), rank=r, world_size=3, seed=0).train_files for r in range(3)
    ]
    assert sum(len(s) for s in shards) == len(train)
    assert set().union(*map(set, shards)) == set(train)
    assert all(set(a).isdisjoint(b) for i, a in enumerate(shards) for b in shards[i + 1 :])


def test_empty_shard_names_rank_and_counts(tmp_path: Path, tiny: tuple[Any, Any]) -> None:
    for i in range(3):
        (tmp_path / f"m{i}.py").write_text(f'"""Module {i}."""\n' + "x = 1\ny = 2\n" * 200)
    with pytest.raises(DataError, match=r"rank 3 of 4 replicas gets no training data \(2 train items, 1 held out\)"):
        StdlibSource(tiny[1], DataConfig(), rank=3, world_size=4, seed=0, root=tmp_path)
    with pytest.raises(DataError, match="rank 5 is outside"):
        StdlibSource(tiny[1], DataConfig(), rank=5, world_size=4, seed=0, root=tmp_path)


def test_small_response_budget_builds_every_rank(tiny: tuple[Any, Any]) -> None:
    """seq_len=64, prompt_len=32 leaves 32 tokens: few pairs of whole stdlib lines fit, and the old
    whole-lines-only chunker gave up ("no chunk fits in 64 tries", e.g. rank 1, example 85)."""
    cfg = _cfg("data.seq_len=64", "data.prompt_len=32", "replicas=4", "loss.dpo_variant=simpo")
    for rank in range(cfg.replicas):
        builder = _builder(tiny, cfg, rank=rank)
        for _ in range(32):
            batch = builder.next_batch()
            n_resp = batch["response_mask"].sum(1)
            assert bool(((n_resp >= 2) & (n_resp <= 32)).all())  # the whole response, never truncated
            assert torch.equal(n_resp, batch["dpo_rejected_response_mask"].sum(1))
            assert torch.equal(n_resp, batch["ctx_teacher_response_mask"].sum(1))
        assert len(list(builder.eval_batches(4))) == 4


@pytest.mark.parametrize(("seq_len", "prompt_len"), [(64, 32), (16, 14)])
def test_lines_longer_than_the_budget_are_cut_into_pieces(tmp_path: Path, seq_len: int, prompt_len: int) -> None:
    """Every line is longer than seq_len - prompt_len: the response is cut inside lines, the
    rejected answer is the same tokens in another order. (16, 14) leaves 2 tokens, the least the
    builder works with; RunConfig refuses it (MIN_RESPONSE_TOKENS), so it is built with model_construct."""

    class Bytes:
        def __call__(self, text: str, **_: Any) -> dict[str, list[int]]:
            return {"input_ids": list(text.encode("utf-8"))}

    for i in range(3):
        body = "".join(f"value_{i}_{j:04d} = compute_something_long({j}, {j * 7})\n" for j in range(60))
        (tmp_path / f"m{i}.py").write_text(body)
    data = DataConfig.model_construct(**{**DataConfig().model_dump(), "seq_len": seq_len, "prompt_len": prompt_len})
    budget = seq_len - prompt_len
    src = StdlibSource(Bytes(), data, rank=0, world_size=1, seed=0, root=tmp_path)
    assert src._byte_level
    for i in range(50):
        ex = src.train_example(i)
        assert 2 <= len(ex.response) <= budget and len(ex.prompt) <= prompt_len
        assert ex.rejected != ex.response and sorted(ex.rejected) == sorted(ex.response)
    assert 2 <= len(src.eval_example(0).response) <= budget


def test_stdlib_batch_has_all_three_channels(tiny: tuple[Any, Any]) -> None:
    model, tok = tiny
    cfg = _cfg()
    builder = _builder(tiny, cfg, rank=1)
    batch = builder.next_batch()
    assert set(batch) == set(STUDENT_KEYS + TEACHER_KEYS + DPO_KEYS + REF_KEYS)
    b, t = cfg.data.batch_size, cfg.data.seq_len
    for key in STUDENT_KEYS + DPO_KEYS:
        assert batch[key].shape == (b, t) and batch[key].dtype == torch.long
    for key in TEACHER_KEYS:
        assert batch[key].shape == (b, t + cfg.data.hint_len)
    # teacher and student score the same response tokens; the teacher also reads the hint
    assert torch.equal(batch["response_mask"].sum(1), batch["ctx_teacher_response_mask"].sum(1))
    for row in range(b):
        resp = _decode(tok, batch["input_ids"][row], batch["response_mask"][row])
        assert resp == _decode(tok, batch["ctx_teacher_input_ids"][row], batch["ctx_teacher_response_mask"][row])
        t_attn, t_resp = batch["ctx_teacher_attention_mask"][row], batch["ctx_teacher_response_mask"][row]
        teacher_prompt = _decode(tok, batch["ctx_teacher_input_ids"][row], t_attn * (1 - t_resp))
        assert teacher_prompt.startswith("# file: ") and ".py" in teacher_prompt
        # DPO: chosen is the true chunk, rejected the same lines in another order
        assert torch.equal(batch["dpo_chosen_input_ids"][row], batch["input_ids"][row])
        rejected = _decode(tok, batch["dpo_rejected_input_ids"][row], batch["dpo_rejected_response_mask"][row])
        assert rejected != resp and Counter(rejected.splitlines()) == Counter(resp.splitlines())
        assert batch["response_mask"][row, 1:].sum() > 0
    ref = make_reference_model(model)
    for side in ("chosen", "rejected"):
        p = f"dpo_{side}_"
        with torch.no_grad():
            expected = sequence_logprobs(
                ref, batch[p + "input_ids"], batch[p + "attention_mask"], batch[p + "response_mask"]
            )
        torch.testing.assert_close(batch[p + "ref_logprobs"], expected)


def test_compose_loss_runs_every_channel_on_a_batch(tiny: tuple[Any, Any]) -> None:
    cfg = _cfg("data.batch_size=2")
    model, _ = build_model(cfg.model, seed=0)
    batch = BatchBuilder.from_config(cfg, tiny[1], rank=0, ref_model=make_reference_model(model)).next_batch()
    out = compose_loss(model, batch, **cfg.loss.compose_kwargs())
    assert torch.isfinite(out.total)
    assert out.lm_ce > 0 and out.sdpo_jsd > 0 and out.trace_replay_dpo > 0
    out.total.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_channels_with_zero_weight_are_left_out(tiny: tuple[Any, Any]) -> None:
    batch = _builder(tiny, _cfg("loss.alpha_sdpo=0", "loss.beta_replay=0")).next_batch()
    assert set(batch) == set(STUDENT_KEYS)
    simpo = BatchBuilder.from_config(_cfg("loss.dpo_variant=simpo"), tiny[1], rank=0).next_batch()
    assert set(simpo) == set(STUDENT_KEYS + TEACHER_KEYS + DPO_KEYS)
    with pytest.raises(DataError, match="rank 0: loss.dpo_variant='dpo'.*make_reference_model"):
        BatchBuilder.from_config(_cfg(), tiny[1], rank=0)


def test_deterministic_and_resumable(tiny: tuple[Any, Any]) -> None:
    cfg = _cfg("loss.beta_replay=0")
    a, b = _builder(tiny, cfg, rank=0), _builder(tiny, cfg, rank=0)
    first = [a.next_batch() for _ in range(3)]
    for x in first:
        y = b.next_batch()
        assert all(torch.equal(x[k], y[k]) for k in x)
    other_rank = _builder(tiny, cfg, rank=1).next_batch()
    assert not torch.equal(other_rank["input_ids"], first[0]["input_ids"])
    other_seed = _builder(tiny, _cfg("loss.beta_replay=0", "seed=1"), rank=0).next_batch()
    assert not torch.equal(other_seed["input_ids"], first[0]["input_ids"])
    # checkpoint after batch 1, restore into a fresh builder, get batch 2 again
    c = _builder(tiny, cfg, rank=0)
    c.next_batch()
    state = json.loads(json.dumps(c.state_dict()))
    d = _builder(tiny, cfg, rank=0)
    d.load_state_dict(state)
    assert state["position"] == cfg.data.batch_size and d.position == state["position"]
    assert torch.equal(d.next_batch()["input_ids"], first[1]["input_ids"])
    with pytest.raises(DataError, match="saved with seed=7"):
        d.load_state_dict({**state, "seed": 7})
    with pytest.raises(DataError, match="non-negative int"):
        d.load_state_dict({"position": -1})


def test_eval_batches_are_fixed_and_held_out(tiny: tuple[Any, Any]) -> None:
    cfg = _cfg("data.eval_batches=2")
    r0, r1 = _builder(tiny, cfg, rank=0), _builder(tiny, cfg, rank=1)
    e0, again, e1 = list(r0.eval_batches()), list(r0.eval_batches()), list(r1.eval_batches(2))
    assert len(e0) == 2 and set(e0[0]) == set(STUDENT_KEYS)
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(e0, again))
    assert all(torch.equal(x["input_ids"], y["input_ids"]) for x, y in zip(e0, e1))
    source = r0.source
    assert isinstance(source, StdlibSource)
    eval_files = {source.eval_example(i).source.split("/", 1)[1].rsplit(":", 1)[0] for i in range(16)}
    assert eval_files <= set(source.eval_files) and eval_files.isdisjoint(source.train_files)


# ------------------------------------------------------------------ JSONL
RECORDS = [
    {"prompt": f"Add {i} and {i + 1}.", "response": f"The sum is\n{2 * i + 1}.", "hint": "Add the numbers."}
    for i in range(10)
] + [
    {"prompt": "Say hi.", "response": "hi there", "chosen": "Hello!", "rejected": "Go away."},
    {"prompt": "Name a colour.", "response": "blue", "extra": "ignored"},
]


def _write_jsonl(url: str, lines: list[str]) -> None:
    with fsspec.open(url, "w") as fh:
        fh.write("\n".join(lines) + "\n")


def test_jsonl_from_fsspec_url_with_chat_template(tiny: tuple[Any, Any], memory_store_url: str) -> None:
    tok = tiny[1]
    url = f"{memory_store_url}/train.jsonl"
    _write_jsonl(url, [json.dumps(r) for r in RECORDS] + [""])
    cfg = _cfg(f'data.source="{url}"', "data.eval_fraction=0.2")
    src = JsonlSource(tok, cfg.data, rank=0, world_size=2, seed=0)
    other = JsonlSource(tok, cfg.data, rank=1, world_size=2, seed=0)
    n_eval = len(src.eval_records)
    assert 1 <= n_eval < len(RECORDS)
    assert len(src.train_records) + len(other.train_records) + n_eval == len(RECORDS)
    seen = {src.train_example(i).source for i in range(len(src.train_records))}
    assert seen == {r.where for r in src.train_records}  # one epoch visits every record once
    ex = src._encode(src.train_records[0], __import__("random").Random(0))
    prompt, response = tok.decode(ex.prompt), tok.decode(ex.response)
    assert prompt.startswith("<|im_start|>user\n") and prompt.endswith("<|im_start|>assistant\n")
    assert response.endswith("<|im_end|>\n") or response.endswith("<|im_end|>")
    rec = src.train_records[0]
    if rec.hint:
        assert rec.hint in tok.decode(ex.teacher_prompt) and rec.hint not in prompt
    batch = _builder(tiny, cfg).next_batch()
    assert set(batch) == set(STUDENT_KEYS + TEACHER_KEYS + DPO_KEYS + REF_KEYS)
    assert torch.equal(batch["response_mask"].sum(1), batch["ctx_teacher_response_mask"].sum(1))


def test_jsonl_pairs_and_no_chat_template(tiny: tuple[Any, Any], tmp_path: Path) -> None:
    from diloco_serverless.trainer.model import build_byte_tokenizer

    tok = build_byte_tokenizer()
    tok.chat_template = None
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in RECORDS))
    src = JsonlSource(tok, DataConfig(source=str(path)), rank=0, world_size=1, seed=0)
    pair = next(r for r in src.train_records + src.eval_records if r.chosen)
    ex = src._encode(pair, __import__("random").Random(0))
    assert tok.decode(ex.prompt) == "Say hi." and tok.decode(ex.response) == "hi there<|endoftext|>"
    assert tok.decode(ex.chosen) == "Hello!<|endoftext|>" and tok.decode(ex.rejected) == "Go away.<|endoftext|>"
    plain = next(r for r in src.train_records + src.eval_records if r.prompt.startswith("Add"))
    synth = src._encode(plain, __import__("random").Random(0))
    assert synth.rejected != synth.response and sorted(synth.rejected) == sorted(synth.response)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "line 2: not valid JSON"),
        ('["a list"]', "line 2: expected a JSON object"),
        ('{"prompt": "p"}', "line 2: field 'response' must be a non-empty string"),
        ('{"prompt": "", "response": "r"}', "line 2: field 'prompt' must be a non-empty string"),
        ('{"prompt": "p", "response": "r", "hint": 3}', "line 2: optional field 'hint' must be a string"),
        ('{"prompt": "p", "response": "r", "chosen": "c"}', "line 2: give both 'chosen' and 'rejected'"),
    ],
)
def test_malformed_jsonl_names_the_line(tmp_path: Path, line: str, message: str, tiny: tuple[Any, Any]) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(RECORDS[0]) + "\n" + line + "\n")
    with pytest.raises(DataError, match=message.replace("line ", f"{path}:").replace("(", r"\(")):
        JsonlSource(tiny[1], DataConfig(source=str(path)), rank=0, world_size=1, seed=0)


def test_jsonl_unreadable_and_empty(tmp_path: Path, tiny: tuple[Any, Any]) -> None:
    with pytest.raises(DataError, match="cannot read JSONL data"):
        JsonlSource(tiny[1], DataConfig(source=str(tmp_path / "missing.jsonl")), rank=0, world_size=1, seed=0)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match="has no records"):
        JsonlSource(tiny[1], DataConfig(source=str(tmp_path / "empty.jsonl")), rank=0, world_size=1, seed=0)
    (tmp_path / "two.jsonl").write_text("\n".join(json.dumps(r) for r in RECORDS[:2]))
    with pytest.raises(DataError, match="rank 1 of 2 replicas gets no training data"):
        JsonlSource(tiny[1], DataConfig(source=str(tmp_path / "two.jsonl")), rank=1, world_size=2, seed=0)


def test_stdlib_with_a_merging_tokenizer_groups_tokens_by_line(tmp_path: Path) -> None:
    """A BPE tokenizer with merges (like any Hub model's) takes the one-call offsets path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from diloco_serverless.data.stdlib import _is_byte_tokenizer, _line_token_ids

    text = '"""Doc of m."""\nimport os\n\n\ndef f(x):\n    return os.path.join(x, x)\n' * 30
    for i in range(3):
        (tmp_path / f"m{i}.py").write_text(text)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        [text],
        trainers.BpeTrainer(
            vocab_size=300, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>", pad_token="<eos>")
    assert not _is_byte_tokenizer(tok)
    lines = text.splitlines(keepends=True)
    grouped = _line_token_ids(tok, text, lines, byte_level=False)
    assert [t for g in grouped for t in g] == tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(grouped[4]).startswith("def f(x)")
    src = StdlibSource(tok, DataConfig(seq_len=64, prompt_len=8), rank=0, world_size=1, seed=0, root=tmp_path)
    ex = src.train_example(0)
    assert ex.response and ex.rejected != ex.response and sorted(ex.rejected) == sorted(ex.response)
    assert tok.decode(ex.teacher_prompt).startswith("# file: m")


def test_long_records_are_truncated_consistently(tiny: tuple[Any, Any], tmp_path: Path) -> None:
    path = tmp_path / "long.jsonl"
    long = {"prompt": "p" * 300, "response": "line\n" * 100, "hint": "h" * 500}
    path.write_text("\n".join(json.dumps(long) for _ in range(4)))
    cfg = _cfg(f'data.source="{path}"', "data.seq_len=64", "data.prompt_len=8", "data.hint_len=16")
    batch = _builder(tiny, cfg).next_batch()
    assert batch["input_ids"].shape == (4, 64) and batch["ctx_teacher_input_ids"].shape == (4, 80)
    assert bool(batch["attention_mask"].all())  # filled to the brim
    n_resp = batch["response_mask"].sum(1)
    assert bool((n_resp >= 32).all())  # the response keeps at least half of seq_len
    assert torch.equal(n_resp, batch["ctx_teacher_response_mask"].sum(1))
    for row in range(4):
        s = batch["input_ids"][row][batch["response_mask"][row].bool()]
        t = batch["ctx_teacher_input_ids"][row][batch["ctx_teacher_response_mask"][row].bool()]
        assert torch.equal(s, t)
