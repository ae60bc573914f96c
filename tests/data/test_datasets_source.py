"""🤗 datasets sources: the four formats end to end, sharding, exact resume, eval, errors, prefetch.

Every dataset is written to ``tmp_path`` (parquet or jsonl), the tokenizer is a BPE trained in the
test (conftest), and datasets runs offline: nothing is downloaded.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_records import chat_rows, pr_rows, pref_rows, text_rows, write_split

from diloco_serverless.config import RunConfig
from diloco_serverless.data import DatasetsSource, JsonlSource, StdlibSource, make_source
from diloco_serverless.data.builder import DPO_KEYS, STUDENT_KEYS, TEACHER_KEYS, BatchBuilder
from diloco_serverless.data.examples import DataError
from diloco_serverless.loss import compose_loss

pytest.importorskip("datasets")
pytestmark = pytest.mark.usefixtures("hf_offline")

TEXT = ["data.format=text", "loss.alpha_sdpo=0", "loss.beta_replay=0"]
CHAT = ["data.format=chat", "loss.beta_replay=0", "data.columns.hint=answer"]
PR = [
    "data.format=prompt_response", "data.columns.prompt=question", "data.columns.response=answer",
    "data.columns.hint=tip", "data.columns.chosen=good", "data.columns.rejected=bad", "loss.dpo_variant=simpo",
]
PREF = ["data.format=preference", "loss.dpo_variant=simpo", "loss.alpha_sdpo=0"]


def _cfg(source: Path | str, *overrides: str) -> RunConfig:
    base = [f'data.source="{source}"', "data.seq_len=48", "data.batch_size=4", "data.hint_len=16",
            "data.prompt_len=8", "data.eval_batches=2", "replicas=1"]
    return RunConfig.load(None, [*base, *overrides])


def _builder(cfg: RunConfig, tok: Any, rank: int = 0, **kw: Any) -> BatchBuilder:
    return BatchBuilder.from_config(cfg, tok, rank=rank, **kw)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def _efficiency(batch: dict[str, torch.Tensor]) -> float:
    return float(batch["attention_mask"].float().mean())


# ---------------------------------------------------------------------------------- formats
@pytest.mark.parametrize(("kind", "streaming"), [("parquet", "false"), ("jsonl", "true"), ("parquet", "true")])
def test_text_packs_documents_without_padding(
    tmp_path: Path, bpe_tokenizer: Any, bpe_model: Any, kind: str, streaming: str
) -> None:
    """Continued pretraining: documents + EOS back to back in seq_len rows, every token but the
    first of a row scored, no padding at all; the rows hold whole training documents, none twice."""
    rows = text_rows(120)
    write_split(tmp_path / "d", "train", rows, kind, shards=3)
    cfg = _cfg(tmp_path / "d", *TEXT, f"data.streaming={streaming}", "data.shuffle_buffer=16")
    builder = _builder(cfg, bpe_tokenizer)
    assert isinstance(builder.source, DatasetsSource) and builder.format == "text"
    batches = [builder.next_batch() for _ in range(12)]
    assert all(set(b) == set(STUDENT_KEYS) for b in batches)
    assert min(_efficiency(b) for b in batches) >= 0.99  # in fact 1.0: rows are full
    for b in batches:
        assert b["input_ids"].shape == (4, 48)
        assert bool(b["response_mask"][:, 1:].all()) and not b["response_mask"][:, 0].any()
    eos = bpe_tokenizer.eos_token_id
    stream = torch.cat([b["input_ids"].reshape(-1) for b in batches]).tolist()
    docs, cur = [], []
    for t in stream:
        if t == eos:
            docs.append(bpe_tokenizer.decode(cur))
            cur = []
        else:
            cur.append(t)
    train_texts = {r["text"] for r in rows}
    assert len(docs) > 10 and all(d in train_texts for d in docs), docs[:3]
    assert len(set(docs)) == len(docs)  # no document twice within the first epoch
    out = compose_loss(bpe_model, batches[0], **cfg.loss.compose_kwargs())
    assert torch.isfinite(out.total) and out.sdpo_jsd == 0 and out.trace_replay_dpo == 0
    builder.close()


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_chat_scores_assistant_turns_and_the_hint_feeds_the_teacher(
    tmp_path: Path, bpe_tokenizer: Any, bpe_model: Any, kind: str
) -> None:
    rows = chat_rows(30)
    write_split(tmp_path / "chat", "train", rows, kind)
    cfg = _cfg(tmp_path / "chat", *CHAT, "data.seq_len=96", "data.prefetch=0")
    builder = _builder(cfg, bpe_tokenizer)
    batch = builder.next_batch()
    assert set(batch) == set(STUDENT_KEYS + TEACHER_KEYS)
    tok = bpe_tokenizer
    for row in range(4):
        ids, resp = batch["input_ids"][row], batch["response_mask"][row].bool()
        full = tok.decode(ids[batch["attention_mask"][row].bool()])
        scored = tok.decode(ids[resp])
        n = int(full.split("Q", 1)[1].split(":", 1)[0].rstrip("b"))  # the record's number
        assert f"A{n}: the sum is {2 * n + 1}<|im_end|>" in scored
        assert "Q" not in scored and "system" not in scored and "<|im_start|>" not in scored
        if n % 3 == 0:  # two exchanges: the second user turn sits inside the response, unscored
            assert f"Q{n}b" in full and f"A{n}b" in scored
        t_ids, t_resp = batch["ctx_teacher_input_ids"][row], batch["ctx_teacher_response_mask"][row].bool()
        assert torch.equal(ids[resp], t_ids[t_resp])  # the same tokens scored in both views
        teacher_prompt = tok.decode(t_ids[batch["ctx_teacher_attention_mask"][row].bool() & ~t_resp])
        assert f"add {n} and {n + 1}\n\n{2 * n + 1}<|im_end|>" in teacher_prompt  # hint after the user turn
    out = compose_loss(bpe_model, batch, **cfg.loss.compose_kwargs())
    assert torch.isfinite(out.total) and out.sdpo_jsd > 0


def test_prompt_response_with_renamed_columns_feeds_all_channels(
    tmp_path: Path, bpe_tokenizer: Any, bpe_model: Any
) -> None:
    write_split(tmp_path / "pr", "train", pr_rows(40), "parquet", shards=2)
    cfg = _cfg(tmp_path / "pr", *PR)
    builder = _builder(cfg, bpe_tokenizer)
    batch = builder.next_batch()
    assert set(batch) == set(STUDENT_KEYS + TEACHER_KEYS + DPO_KEYS)
    tok = bpe_tokenizer
    for row in range(4):
        t_ids, t_att = batch["ctx_teacher_input_ids"][row], batch["ctx_teacher_attention_mask"][row].bool()
        t_resp = batch["ctx_teacher_response_mask"][row].bool()
        assert "Add the numbers." in tok.decode(t_ids[t_att & ~t_resp])
        assert "Add the numbers." not in tok.decode(batch["input_ids"][row])
        chosen = tok.decode(batch["dpo_chosen_input_ids"][row][batch["dpo_chosen_response_mask"][row].bool()])
        rejected = tok.decode(batch["dpo_rejected_input_ids"][row][batch["dpo_rejected_response_mask"][row].bool()])
        assert chosen != rejected
    out = compose_loss(bpe_model, batch, **cfg.loss.compose_kwargs())
    assert torch.isfinite(out.total) and out.sdpo_jsd > 0 and out.trace_replay_dpo > 0


def test_preference_takes_prompt_and_answers_from_conversations(
    tmp_path: Path, bpe_tokenizer: Any, bpe_model: Any
) -> None:
    rows = pref_rows(24)
    for r in rows[::2]:
        r["prompt"] = None  # then the prompt comes from the conversation before the answer
    write_split(tmp_path / "pref", "train", rows, "jsonl")
    cfg = _cfg(tmp_path / "pref", *PREF)
    batch = _builder(cfg, bpe_tokenizer).next_batch()
    assert set(batch) == set(STUDENT_KEYS + DPO_KEYS)
    tok = bpe_tokenizer
    assert torch.equal(batch["input_ids"], batch["dpo_chosen_input_ids"])  # channel 1 learns the chosen answer
    for row in range(4):
        prompt = tok.decode(batch["input_ids"][row][batch["attention_mask"][row].bool()
                                                    & ~batch["response_mask"][row].bool()])
        assert prompt.startswith("<|im_start|>user\nAdd ") and prompt.endswith("<|im_start|>assistant\n")
        rej = batch["dpo_rejected_input_ids"][row][batch["dpo_rejected_response_mask"][row].bool()]
        assert tok.decode(rej).startswith("The sum is ")
    out = compose_loss(bpe_model, batch, **cfg.loss.compose_kwargs())
    assert torch.isfinite(out.total) and out.trace_replay_dpo > 0


def test_auto_format_detection_and_source_routing(tmp_path: Path, bpe_tokenizer: Any) -> None:
    write_split(tmp_path / "pref", "train", pref_rows(12), "parquet")
    write_split(tmp_path / "chat", "train", chat_rows(12), "parquet")
    assert _builder(_cfg(tmp_path / "pref", "loss.dpo_variant=simpo"), bpe_tokenizer).format == "preference"
    assert _builder(_cfg(tmp_path / "chat", "loss.beta_replay=0"), bpe_tokenizer).format == "chat"
    jsonl = tmp_path / "one.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": f"p{i}", "response": f"r{i}"}) + "\n" for i in range(6)))
    data = _cfg(jsonl).data
    assert isinstance(make_source(data, bpe_tokenizer, rank=0, world_size=1, seed=0), JsonlSource)
    explicit = data.model_copy(update={"format": "prompt_response"})
    assert isinstance(make_source(explicit, bpe_tokenizer, rank=0, world_size=1, seed=0), DatasetsSource)
    assert isinstance(make_source(RunConfig().data, bpe_tokenizer, rank=0, world_size=1, seed=0), StdlibSource)


def test_a_config_read_back_from_run_json_builds_the_same_batches(tmp_path: Path, bpe_tokenizer: Any) -> None:
    """Replicas read the config from run.json, where every field is written out: optional columns
    under their default names may still be absent from the data."""
    rows = [{"prompt": f"Say {i}.", "response": f"{i} {i}\n{i + 1}"} for i in range(20)]  # no hint / pair
    write_split(tmp_path / "d", "train", rows, "parquet")
    cfg = _cfg(tmp_path / "d", "data.format=prompt_response", "loss.dpo_variant=simpo")
    stored = RunConfig.from_dict(json.loads(json.dumps(cfg.to_json_dict())))
    assert stored.data.columns.model_fields_set == set(type(stored.data.columns).model_fields)
    a, b = _builder(cfg, bpe_tokenizer), _builder(stored, bpe_tokenizer)
    assert all(_same(a.next_batch(), b.next_batch()) for _ in range(3))


# ---------------------------------------------------------------------------------- sharding
def _epoch_rows(source: DatasetsSource, column: str) -> list[Any]:
    """The values of ``column`` of one epoch of the rank's training records, in reading order."""
    records = source.open().records
    out = []
    while True:
        row, _, key = records.next()
        if key[0] != 0:
            return out
        out.append(row[column])


@pytest.mark.parametrize(("streaming", "shards"), [(False, 1), (True, 3), (True, 2)])
def test_ranks_read_disjoint_shards_that_cover_the_training_records(
    tmp_path: Path, bpe_tokenizer: Any, streaming: bool, shards: int
) -> None:
    """3 ranks: 3 files (whole files per rank), 2 files (every 3rd record) or prepared rows."""
    rows = text_rows(90)
    write_split(tmp_path / "d", "train", rows, "parquet", shards=shards)
    data = _cfg(tmp_path / "d", *TEXT, f"data.streaming={str(streaming).lower()}", "data.eval_fraction=0.1").data
    sources = [DatasetsSource(bpe_tokenizer, data, rank=r, world_size=3, seed=0) for r in range(3)]
    epochs = [_epoch_rows(s, "text") for s in sources]
    seen = [t for e in epochs for t in e]
    assert len(seen) == len(set(seen))  # disjoint, and no record twice in an epoch
    held_out = {sources[0].eval_example(i).source for i in range(3)}
    assert held_out  # eval exists ...
    n_eval = sum(1 for r in rows if r["text"] not in set(seen))
    assert set(seen) <= {r["text"] for r in rows} and 0 < n_eval < 20  # ... and is left out of training
    again = DatasetsSource(bpe_tokenizer, data, rank=1, world_size=3, seed=0)
    assert _epoch_rows(again, "text") == epochs[1]  # deterministic
    other_seed = DatasetsSource(bpe_tokenizer, data, rank=1, world_size=3, seed=1)
    assert _epoch_rows(other_seed, "text") != epochs[1] and set(_epoch_rows(other_seed, "text")) == set(epochs[1])
    if streaming:  # a window of 1 record is the stream's own order: the default window shuffles it
        unshuffled = DatasetsSource(bpe_tokenizer, data.model_copy(update={"shuffle_buffer": 1}), rank=1,
                                    world_size=3, seed=0)
        in_order = _epoch_rows(unshuffled, "text")
    else:  # a prepared shard is rows [start, end) of the split, permuted
        in_order = sorted(epochs[1], key=lambda t: int(t.split()[0][3:]))
    assert in_order != epochs[1] and set(in_order) == set(epochs[1])


# ---------------------------------------------------------------------------------- resume
RESUME_CASES = [
    ("text-stream", "parquet", [*TEXT, "data.streaming=true", "data.shuffle_buffer=7"], text_rows(60), 3),
    ("text-prepared", "jsonl", [*TEXT, "data.streaming=false"], text_rows(40), 1),
    ("chat-stream", "jsonl", [*CHAT, "data.streaming=true", "data.shuffle_buffer=5", "data.seq_len=96"],
     chat_rows(30), 2),
    ("pr-prepared", "parquet", [*PR], pr_rows(30), 1),
]


@pytest.mark.parametrize(
    ("name", "kind", "overrides", "rows", "shards"), RESUME_CASES, ids=[c[0] for c in RESUME_CASES]
)
def test_a_restarted_builder_resumes_at_the_exact_next_record(
    tmp_path: Path, bpe_tokenizer: Any, name: str, kind: str, overrides: list[str], rows: list[dict[str, Any]],
    shards: int,
) -> None:
    """Build, take k batches, save the state (through JSON), rebuild from it: the next batches equal
    those of a builder that never stopped, across shuffle windows, packed documents and epochs."""
    write_split(tmp_path / "d", "train", rows, kind, shards=shards)
    cfg = _cfg(tmp_path / "d", *overrides, "replicas=2")
    reference = _builder(cfg, bpe_tokenizer, rank=1)
    expected = [reference.next_batch() for _ in range(16)]  # several epochs of the small shard
    for k in (1, 3, 7, 11):
        first = _builder(cfg, bpe_tokenizer, rank=1)
        for i in range(k):
            assert _same(first.next_batch(), expected[i])
        state = json.loads(json.dumps(first.state_dict()))
        first.close()
        resumed = _builder(cfg, bpe_tokenizer, rank=1)
        resumed.load_state_dict(state)
        assert resumed.position == k * cfg.data.batch_size
        for i in range(k, min(k + 4, len(expected))):
            assert _same(resumed.next_batch(), expected[i]), f"{name}: batch {i} after resuming at {k}"
        resumed.close()
    reference.close()


def test_moving_the_position_of_a_stream_reads_forward_or_restarts(tmp_path: Path, bpe_tokenizer: Any) -> None:
    """What the trainer does after healing (position += replayed rounds' examples) on a stream."""
    write_split(tmp_path / "d", "train", text_rows(50), "parquet", shards=2)
    cfg = _cfg(tmp_path / "d", *TEXT, "data.streaming=true", "data.shuffle_buffer=6")
    expected = [b for b, _ in zip(_builder(cfg, bpe_tokenizer), range(8))]
    b = cfg.data.batch_size
    builder = _builder(cfg, bpe_tokenizer)
    builder.position = 3 * b
    assert _same(builder.next_batch(), expected[3])
    state = builder.state_dict()
    builder.position += 2 * b  # forward from a known stream state
    assert _same(builder.next_batch(), expected[6])
    builder.position = b  # backward: from the start
    assert _same(builder.next_batch(), expected[1])
    builder.load_state_dict(state)
    builder.position = state["position"] + b
    assert _same(builder.next_batch(), expected[5])
    legacy = _builder(cfg, bpe_tokenizer)
    legacy.load_state_dict({"position": 2 * b, "seed": 0, "source": cfg.data.source})  # no stream state
    assert _same(legacy.next_batch(), expected[2])
    with pytest.raises(DataError, match="saved with format='chat'"):
        legacy.load_state_dict({**state, "format": "chat"})


def test_prefetch_gives_the_same_batches_and_accounts_the_wait(tmp_path: Path, bpe_tokenizer: Any) -> None:
    write_split(tmp_path / "d", "train", pr_rows(40), "parquet")
    inline = _builder(_cfg(tmp_path / "d", *PR, "data.prefetch=0"), bpe_tokenizer)
    ahead = _builder(_cfg(tmp_path / "d", *PR, "data.prefetch=3"), bpe_tokenizer)
    assert ahead.data_wait_s == 0.0
    for _ in range(5):
        assert _same(inline.next_batch(), ahead.next_batch())
    assert inline.data_wait_s > 0 and ahead.data_wait_s > 0
    waited = inline.reset_data_wait()
    assert waited > 0 and inline.data_wait_s == 0.0
    time.sleep(0.5)  # the worker fills its queue meanwhile: taking a batch then waits (almost) nothing
    ahead.reset_data_wait()
    ahead.next_batch()
    assert ahead.data_wait_s < waited
    worker = ahead._worker[0]
    assert worker is not None and worker.alive
    ahead.close()
    assert ahead._worker[0] is None and not worker.alive
    assert not any(t.name.startswith("diloco-data") and t.is_alive() for t in threading.enumerate()
                   if t is worker._thread)


# ---------------------------------------------------------------------------------- eval
def test_eval_is_a_named_split_or_a_held_out_fraction(tmp_path: Path, bpe_tokenizer: Any) -> None:
    write_split(tmp_path / "d", "train", pr_rows(30), "jsonl")
    test = pr_rows(8, seed=9)
    for r in test:
        r["question"] = "EVAL " + r["question"]
    write_split(tmp_path / "d", "test", test, "jsonl")
    named = _cfg(tmp_path / "d", *PR, "data.eval_split=test", "replicas=2")
    r0, r1 = _builder(named, bpe_tokenizer, rank=0), _builder(named, bpe_tokenizer, rank=1)
    e0, e1 = list(r0.eval_batches()), list(r1.eval_batches())
    assert len(e0) == 2 and set(e0[0]) == set(STUDENT_KEYS)
    assert all(_same(a, b) for a, b in zip(e0, e1))  # the same on every rank ...
    assert all(_same(a, b) for a, b in zip(e0, r0.eval_batches()))  # ... and every call
    assert all("EVAL" in bpe_tokenizer.decode(row) for b in e0 for row in b["input_ids"])
    assert not any("EVAL" in bpe_tokenizer.decode(row) for row in r0.next_batch()["input_ids"])
    held = _builder(_cfg(tmp_path / "d", *PR, "data.eval_fraction=0.2"), bpe_tokenizer)
    eval_prompts = {bpe_tokenizer.decode(row).split(".")[0] for b in held.eval_batches() for row in b["input_ids"]}
    train_prompts = {bpe_tokenizer.decode(row).split(".")[0] for _ in range(8)
                     for row in held.next_batch()["input_ids"]}
    assert eval_prompts and not any("EVAL" in p for p in eval_prompts) and eval_prompts.isdisjoint(train_prompts)


def test_save_to_disk_folder_and_an_fsspec_url(tmp_path: Path, bpe_tokenizer: Any, memory_store_url: str) -> None:
    import datasets
    import fsspec

    dd = datasets.DatasetDict({
        "train": datasets.Dataset.from_list(text_rows(40)), "validation": datasets.Dataset.from_list(text_rows(10, 1)),
    })
    dd.save_to_disk(str(tmp_path / "saved"))
    for streaming in ("false", "true"):
        cfg = _cfg(tmp_path / "saved", *TEXT, "data.eval_split=validation", f"data.streaming={streaming}")
        builder = _builder(cfg, bpe_tokenizer)
        assert _efficiency(builder.next_batch()) == 1.0 and len(list(builder.eval_batches())) == 2
    url = f"{memory_store_url}/chats/train.jsonl"
    with fsspec.open(url, "w") as fh:
        fh.write("".join(json.dumps(r) + "\n" for r in chat_rows(12)))
    cfg = _cfg(f"{memory_store_url}/chats/*.jsonl", *CHAT, "data.streaming=true", "data.seq_len=96")
    assert set(_builder(cfg, bpe_tokenizer).next_batch()) == set(STUDENT_KEYS + TEACHER_KEYS)


# ---------------------------------------------------------------------------------- errors
def _first_batch(cfg: RunConfig, tok: Any, **kw: Any) -> None:
    _builder(cfg, tok, **kw).next_batch()


ERRORS = [
    ("missing column", "pr", [*PR[:-2], "data.columns.response=reply"],
     r"split 'train': data.format='prompt_response' needs column 'reply', which it lacks \(columns: .*question.*\); "
     r"set data.columns.response"),
    ("wrong type", "pr_int", PR, r"row \d+: column 'answer' must be a string, got int 7"),
    ("no assistant turn", "chat_user_only", CHAT, r"row \d+: column 'messages' has no assistant turn"),
    ("bad message", "chat_bad_msg", CHAT, r"row \d+: column 'messages' message 1 must be \{role: str, content: str\}"),
    ("lone chosen", "pr_lone", PR, r"row \d+: column 'good' is set but 'bad' is not"),
    ("explicit hint column", "chat", [*CHAT[:-1], "data.columns.hint=why"], r"needs column 'why'"),
    ("text with channels", "text", ["data.format=text"], r"data.format='text' .* set both to 0"),
    ("chat with pairs", "chat", ["data.format=chat", "loss.dpo_variant=simpo"], r"format='chat' has no preference"),
    ("unknown columns", "odd", [], r"has columns \['x', 'y'\], none of a known format; set data.format"),
    ("eval split", "text", [*TEXT, "data.eval_split=test"], r"has no split 'test' \(found train\)"),
    ("no such folder", "text", [*TEXT, 'data.source="/nonexistent/data"'], r"/nonexistent/data does not exist"),
]


@pytest.mark.parametrize(("name", "data", "overrides", "message"), ERRORS, ids=[e[0] for e in ERRORS])
def test_schema_problems_are_one_line_errors_naming_column_and_record(
    tmp_path: Path, bpe_tokenizer: Any, name: str, data: str, overrides: list[str], message: str
) -> None:
    rows: dict[str, list[dict[str, Any]]] = {
        "pr": pr_rows(10), "text": text_rows(10), "chat": chat_rows(10),
        "pr_int": [*pr_rows(5), {**pr_rows(1)[0], "answer": 7}],
        "chat_user_only": [{"messages": [{"role": "user", "content": "hi"}], "answer": "x"}] * 6,
        "chat_bad_msg": [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}], "answer": "x"}] * 6,
        "pr_lone": [{**r, "bad": None} for r in pr_rows(8)],
        "odd": [{"x": i, "y": "z"} for i in range(6)],
    }
    write_split(tmp_path / "d", "train", rows[data], "jsonl")
    cfg = _cfg(tmp_path / "d", "data.prefetch=0", "data.eval_fraction=0.01", *overrides)
    with pytest.raises(DataError, match=message) as info:
        builder = _builder(cfg, bpe_tokenizer)
        for _ in range(3):
            builder.next_batch()
    assert "\n" not in str(info.value)


def test_empty_shards_name_the_rank(tmp_path: Path, bpe_tokenizer: Any) -> None:
    write_split(tmp_path / "d", "train", pr_rows(3), "parquet")
    prepared = _cfg(tmp_path / "d", *PR, "replicas=4")
    with pytest.raises(DataError, match=r"rank 3 of 4 replicas gets no training data \(3 records\)"):
        _builder(prepared, bpe_tokenizer, rank=3)
    streamed = _cfg(tmp_path / "d", *PR, "replicas=4", "data.streaming=true")
    builder = _builder(streamed, bpe_tokenizer, rank=3)  # a stream only knows once it has read its shard
    with pytest.raises(DataError, match=r"rank 3 read no training records in epoch 0"):
        builder.next_batch()
    with pytest.raises(DataError, match="rank 4 is outside"):
        _builder(streamed, bpe_tokenizer, rank=4)


def test_a_text_shard_of_empty_documents_stops_instead_of_spinning(tmp_path: Path, bpe_tokenizer: Any) -> None:
    write_split(tmp_path / "d", "train", [{"text": ""} for _ in range(30)], "parquet")
    write_split(tmp_path / "d", "test", text_rows(5), "parquet")
    builder = _builder(_cfg(tmp_path / "d", *TEXT, "data.prefetch=0", "data.eval_split=test"), bpe_tokenizer)
    with pytest.raises(DataError, match="every document of this shard is empty"):
        builder.next_batch()


def test_without_datasets_the_error_names_the_extra(
    tmp_path: Path, bpe_tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_split(tmp_path / "d", "train", text_rows(5), "parquet")
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(DataError, match=r"pip install 'diloco-serverless\[data\]'"):
        _builder(_cfg(tmp_path / "d", *TEXT), bpe_tokenizer)
