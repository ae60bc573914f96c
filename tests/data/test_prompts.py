"""data.format = "prompt": rendering, columns travelling with the prompt, sharding and exact resume."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from diloco_serverless.config import RunConfig
from diloco_serverless.data import BatchBuilder, DataError, PromptBatcher
from tests.support.tiny_tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def tok() -> Any:
    return build_tokenizer()


def _rows(n: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for i in range(n):
        prompt: Any = f"Add {i} and {i + 1}." if i % 2 else [{"role": "user", "content": f"Add {i} and {i + 1}."}]
        rows.append({"prompt": prompt, "answer": str(2 * i + 1), "id": i})
    return rows


def _cfg(source: str = "prompts.jsonl", extra: dict[str, Any] | None = None) -> RunConfig:
    sets = [
        f'data.source="{source}"', 'data.format="prompt"', 'loss.channel1="grpo"',
        'rl.reward_funcs=["diloco_serverless.rl.rewards:exact_match"]', "data.batch_size=3", "data.seq_len=48",
        "rl.max_completion_length=16", "replicas=2", "data.eval_fraction=0.1",
    ] + [f"{k}={v}" for k, v in (extra or {}).items()]  # fmt: skip
    return RunConfig.load(None, sets)


def test_jsonl_prompts_render_and_carry_columns(tok: Any, tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in _rows(20)) + "\n")
    batcher = PromptBatcher.from_config(_cfg(str(path)), tok, rank=0)
    batch = batcher.next_batch()
    assert len(batch) == 3 and batcher.position == 3
    for rec in batch:
        i = rec.columns["id"]
        assert rec.columns == {"answer": str(2 * i + 1), "id": i}
        if isinstance(rec.prompt, list):  # messages: chat template + generation prompt
            text = tok.apply_chat_template(rec.prompt, tokenize=False, add_generation_prompt=True)
            assert text.endswith("<|im_start|>assistant\n")
            assert rec.prompt_ids == tok(text, add_special_tokens=False)["input_ids"]
        else:
            assert rec.prompt_ids == tok(rec.prompt)["input_ids"]


def test_ranks_get_disjoint_shards_and_resume_exactly(tok: Any) -> None:
    rows = _rows(30)
    seen = []
    for rank in (0, 1):
        b = PromptBatcher.from_config(_cfg(), tok, rank=rank, rows=rows)
        seen.append({row["id"] for _, row in b.source.train_rows})
    assert not seen[0] & seen[1] and len(seen[0] | seen[1]) >= 25

    a = PromptBatcher.from_config(_cfg(), tok, rank=1, rows=rows)
    full = [[r.columns["id"] for r in a.next_batch()] for _ in range(8)]  # past one epoch of the shard
    b = PromptBatcher.from_config(_cfg(), tok, rank=1, rows=rows)
    for _ in range(5):
        b.next_batch()
    state = json.loads(json.dumps(b.state_dict()))
    c = PromptBatcher.from_config(_cfg(), tok, rank=1, rows=rows)
    c.load_state_dict(state)
    assert [[r.columns["id"] for r in c.next_batch()] for _ in range(3)] == full[5:]
    eval_ids = [r.columns["id"] for r in next(iter(c.eval_batches(1)))]
    assert not set(eval_ids) & seen[0] and not set(eval_ids) & seen[1]


def test_long_prompts_keep_their_last_tokens(tok: Any) -> None:
    rows = [
        {"prompt": "the model " * 40, "answer": "x"},
        {"prompt": "a b", "answer": "y"},
        {"prompt": "c", "answer": "z"},
    ]
    b = PromptBatcher.from_config(_cfg(extra={"data.batch_size": 1, "replicas": 1}), tok, rank=0, rows=rows)
    lengths = [len(b.source.train_record(i).prompt_ids) for i in range(len(b.source.train_rows))]
    assert max(lengths) == 48 - 16


def test_bad_prompt_records_are_named(tok: Any) -> None:
    with pytest.raises(DataError, match=r"rows\[1\]: no prompt column 'prompt'"):
        PromptBatcher.from_config(_cfg(), tok, rank=0, rows=[{"prompt": "a"}, {"question": "b"}, {"prompt": "c"}])
    with pytest.raises(DataError, match=r"3 of 3 rows read are unusable.*must be a prompt string or a list"):
        PromptBatcher.from_config(
            _cfg(extra={"replicas": 1}), tok, rank=0, rows=[{"prompt": 3}, {"prompt": 4}, {"prompt": 5}]
        )
    with pytest.raises(DataError, match="PromptBatcher"):
        BatchBuilder.from_config(_cfg(), tok, rank=0)


def test_rl_config_needs_prompts_and_rewards() -> None:
    from diloco_serverless.errors import ConfigError

    with pytest.raises(ConfigError, match="rl.reward_funcs"):
        RunConfig.load(None, ['loss.channel1="grpo"', 'data.format="prompt"', 'data.source="p.jsonl"'])
    with pytest.raises(ConfigError, match='data.format="prompt"'):
        RunConfig.load(None, ['loss.channel1="dppo"', 'rl.reward_funcs=["m:f"]', 'data.source="p.jsonl"'])
    with pytest.raises(ConfigError, match="one weight per function"):
        RunConfig.load(None, ['rl.reward_funcs=["m:f"]', "rl.reward_weights=[1.0, 2.0]"])
    with pytest.raises(ConfigError, match="module:function"):
        RunConfig.load(None, ['rl.reward_funcs=["nofunction"]'])


def _file_with_bad_rows(tmp_path: Path) -> Path:
    """20 usable prompts and 4 unusable lines: not JSON, not an object, no prompt column, a number as prompt."""
    lines = [json.dumps(r) for r in _rows(20)]
    lines[3:3] = ['{"prompt": "unterminated', json.dumps(["a", "list"]), json.dumps({"question": "q"}),
                  json.dumps({"prompt": 7, "answer": "7"})]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_bad_rows_are_skipped_counted_and_reported_by_the_rl_position(tok: Any, tmp_path: Path) -> None:
    from diloco_serverless.trainer.steps import _RolloutPosition

    path = _file_with_bad_rows(tmp_path)
    cfg = _cfg(str(path), {"data.max_bad_fraction": 0.2, "replicas": 1})
    b = PromptBatcher.from_config(cfg, tok, rank=0)
    counts = b.source.bad_rows
    assert (counts.bad, counts.seen) == (4, 24)
    assert [e.split(": ", 1)[0] for e in counts.examples] == [f"{path}:4", f"{path}:5", f"{path}:6"]
    ids = {row["id"] for _, row in [*b.source.train_rows, *b.source.eval_rows]}
    assert ids == set(range(20))  # every usable row, none of the bad ones
    assert _RolloutPosition(b, 1).bad_rows == 4  # the data_bad_rows metric of an RL run
    with pytest.raises(DataError, match=r"prompt data .*: 4 of 24 rows read are unusable, more than "
                                        r"data.max_bad_fraction=0.1; fix the data .* Examples: .*:4: not JSON"):
        PromptBatcher.from_config(_cfg(str(path), {"data.max_bad_fraction": 0.1, "replicas": 1}), tok, rank=0)


def test_a_prompt_that_cannot_be_rendered_gives_way_to_the_next_and_resume_stays_exact(tok: Any) -> None:
    import copy

    plain = copy.deepcopy(tok)
    plain.chat_template = None  # messages cannot be rendered: found when first used
    rows = [{"prompt": f"Add {i} and {i + 1}.", "id": i} for i in range(20)]
    rows[5] = {"prompt": [{"role": "user", "content": "hi"}], "id": 5}
    cfg = _cfg(extra={"data.max_bad_fraction": 0.1, "replicas": 1, "data.eval_fraction": 0.2})
    b = PromptBatcher.from_config(cfg, plain, rank=0, rows=rows)
    n_train, n_eval = len(b.source.train_rows), len(b.source.eval_rows)
    train = [b.source.train_record(i).columns["id"] for i in range(2 * n_train)]
    evals = [b.source.eval_record(i).columns["id"] for i in range(n_eval)]
    assert 5 not in train and 5 not in evals and b.source.bad_rows.bad == 1
    fresh = PromptBatcher.from_config(cfg, plain, rank=0, rows=rows)  # a resumed replica: nothing seen yet
    assert [fresh.source.train_record(i).columns["id"] for i in range(n_train, 2 * n_train)] == train[n_train:]
    with pytest.raises(DataError, match="none of rank 0's 1 training prompts can be rendered"):
        only = [{"prompt": [{"role": "user", "content": "x"}]}, {"prompt": "y"}]
        one = PromptBatcher.from_config(_cfg(extra={"data.max_bad_fraction": 0.9, "replicas": 1}), plain, rank=0,
                                        rows=only)
        assert len(one.source.train_rows) == 1 and one.source.train_rows[0][1]["prompt"] != "y"
        one.next_batch()
