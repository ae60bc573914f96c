"""The built-in JSONL reader skips unusable lines: counted, named (file:line), judged against
``data.max_bad_fraction``, and addressed by index the same way on every replica and after a resume.

Three kinds of bad line: not JSON, JSON of the wrong shape, and a record that parses but that the
chat template refuses (a template with its own ``raise_exception``, found only when encoded).
"""

from __future__ import annotations

import copy
import json
import logging
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from diloco_serverless.config import RunConfig
from diloco_serverless.data.builder import BatchBuilder
from diloco_serverless.data.examples import DataError
from diloco_serverless.data.jsonl import JsonlSource
from diloco_serverless.loss import compose_loss
from diloco_serverless.trainer.model import CHAT_TEMPLATE, build_model

REFUSED = "FORBIDDEN"
#: the tiny model's ChatML template, refusing any message that contains REFUSED
STRICT_TEMPLATE = (
    "{% for message in messages %}{% if '" + REFUSED + "' in message['content'] %}"
    "{{ raise_exception('this template refuses the word " + REFUSED + "') }}{% endif %}{% endfor %}"
    + CHAT_TEMPLATE
)
MALFORMED = '{"prompt": "unterminated'
WRONG_SHAPE = '{"prompt": "no response here", "response": 7}'


@pytest.fixture(scope="module")
def tiny() -> tuple[Any, Any]:
    torch.set_num_threads(1)
    model, tok = build_model(RunConfig().model, seed=0)
    strict = copy.deepcopy(tok)
    strict.chat_template = STRICT_TEMPLATE
    return model, strict


def _good(i: int) -> str:
    return json.dumps({"prompt": f"Add {i} and {i + 1}.", "response": f"The sum is {2 * i + 1}.", "hint": "Add."})


def _write(path: Path, good: int, bad: dict[int, str]) -> Path:
    """``good`` usable lines with the ``bad`` ones inserted at those (1-based) line numbers."""
    lines = [_good(i) for i in range(good)]
    for line_no in sorted(bad):
        lines.insert(line_no - 1, bad[line_no])
    path.write_text("\n".join(lines) + "\n")
    return path


def _cfg(path: Path, *overrides: str) -> RunConfig:
    return RunConfig.load(None, [f'data.source="{path}"', "data.batch_size=4", "data.seq_len=64",
                                 "data.prefetch=0", "loss.beta_replay=0", "replicas=2", *overrides])


def _refused(line_no: int) -> str:
    return json.dumps({"prompt": f"Say {REFUSED} {line_no}.", "response": "No."})


def test_a_file_with_a_malformed_a_wrong_shape_and_a_refused_line_trains(
    tmp_path: Path, tiny: tuple[Any, Any], caplog: pytest.LogCaptureFixture
) -> None:
    # 3 unusable lines of 303: within the default 1%
    path = _write(tmp_path / "d.jsonl", 300, {5: MALFORMED, 77: WRONG_SHAPE, 150: _refused(150)})
    model, tok = tiny
    with caplog.at_level(logging.WARNING, logger="diloco_serverless.data.bad_rows"):
        builder = BatchBuilder.from_config(_cfg(path), tok, rank=0, world_size=1)
        src = builder.source
        assert isinstance(src, JsonlSource)
        assert builder.bad_rows == 2  # the two that do not parse, found when the file is read
        assert src.bad_rows.seen == 303
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(2):
            loss = compose_loss(model, builder.next_batch()).total
            assert torch.isfinite(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
        # a whole epoch and every eval record: the refused record is met, counted once, never returned
        n, m = len(src.train_records), len(src.eval_records)
        sources = [src.train_example(i).source for i in range(2 * n)] + [src.eval_example(j).source for j in range(m)]
    assert builder.bad_rows == 3 and src.bad_rows.seen == 303
    assert f"{path}:150" not in sources and not {f"{path}:5", f"{path}:77"} & set(sources)
    usable = {r.where for r in src.train_records + src.eval_records}
    assert len(usable) == 301 and f"{path}:150" in usable  # it parses; only encoding it fails
    assert set(sources) == usable - {f"{path}:150"}
    warned = [r.getMessage() for r in caplog.records]
    for line, why in ((5, "not valid JSON"), (77, "field 'response' must be a non-empty string"),
                      (150, "the chat template cannot render this record: this template refuses")):
        named = [w for w in warned if f"{path}:{line}: {why}" in w]
        assert len(named) == 1 and "skipping an unusable row" in named[0], (line, warned)


def test_a_refused_record_gives_way_to_the_next_one_in_the_epochs_order(tmp_path: Path, tiny: tuple[Any, Any]) -> None:
    path = _write(tmp_path / "d.jsonl", 40, {10: _refused(10)})
    src = JsonlSource(tiny[1], _cfg(path, "data.max_bad_fraction=0.05").data, rank=0, world_size=1, seed=0)
    bad = next((k for k, r in enumerate(src.train_records) if REFUSED in r.prompt), None)
    if bad is None:  # held out for eval: the eval example that lands on it is the next record's
        j = next(k for k, r in enumerate(src.eval_records) if REFUSED in r.prompt)
        m = len(src.eval_records)
        assert src.eval_example(j).source == src.eval_records[(j + 1) % m].where
        return
    src.train_example(0)
    order, n = src._order.order, len(src.train_records)
    offset = order.index(bad)
    assert src.train_example(offset).source == src.train_records[order[(offset + 1) % n]].where
    assert src.bad_rows.bad == 1
    # the same on a fresh source that starts right at that index (a resumed replica)
    fresh = JsonlSource(tiny[1], _cfg(path, "data.max_bad_fraction=0.05").data, rank=0, world_size=1, seed=0)
    assert fresh.train_example(offset) == src.train_example(offset)


def test_more_unusable_lines_than_max_bad_fraction_stop_naming_them(tmp_path: Path, tiny: tuple[Any, Any]) -> None:
    tok = tiny[1]
    path = _write(tmp_path / "d.jsonl", 20, {3: MALFORMED, 7: "[1, 2]"})
    with pytest.raises(DataError) as info:
        JsonlSource(tok, _cfg(path).data, rank=0, world_size=1, seed=0)
    message = str(info.value)
    assert "\n" not in message
    assert re.search(r"JSONL data .*d\.jsonl: 2 of 22 rows read are unusable, more than data\.max_bad_fraction=0\.01; "
                     r"fix the data or raise data\.max_bad_fraction", message)
    assert f"Examples: {path}:3: not valid JSON" in message and f"| {path}:7: expected a JSON object" in message
    lenient = JsonlSource(tok, _cfg(path, "data.max_bad_fraction=0.1").data, rank=0, world_size=1, seed=0)
    assert lenient.bad_rows.bad == 2 and len(lenient.train_records) + len(lenient.eval_records) == 20
    # 0: the first unusable line stops the run, even one in 301
    one = _write(tmp_path / "one.jsonl", 300, {200: WRONG_SHAPE})
    JsonlSource(tok, _cfg(one).data, rank=0, world_size=1, seed=0)
    with pytest.raises(DataError, match=rf"1 of 301 rows read are unusable.*Examples: {re.escape(str(one))}:200: "):
        JsonlSource(tok, _cfg(one, "data.max_bad_fraction=0").data, rank=0, world_size=1, seed=0)
    # refused records are found while training and judged on the same count of lines
    refused = _write(tmp_path / "refused.jsonl", 30, {k: _refused(k) for k in (2, 9, 16, 23, 30)})
    builder = BatchBuilder.from_config(_cfg(refused, "data.max_bad_fraction=0.1"), tok, rank=0, world_size=1)
    with pytest.raises(DataError, match=r"4 of 35 rows read are unusable, more than data.max_bad_fraction=0.1; .*"
                                        rf"Examples: {re.escape(str(refused))}:\d+: the chat template cannot render"):
        for _ in range(20):
            builder.next_batch()
            list(builder.eval_batches())


def _batches(builder: BatchBuilder, n: int) -> list[dict[str, torch.Tensor]]:
    return [builder.next_batch() for _ in range(n)]


def _same(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> bool:
    return len(a) == len(b) and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
                                    for x, y in zip(a, b))


@pytest.mark.parametrize("prefetch", [0, 2])
def test_a_resumed_replica_makes_the_batches_of_one_that_never_stopped(
    tmp_path: Path, tiny: tuple[Any, Any], prefetch: int
) -> None:
    bad = {3: MALFORMED, 12: _refused(12), 25: WRONG_SHAPE, 31: _refused(31), 44: _refused(44)}
    path = _write(tmp_path / "d.jsonl", 60, bad)
    cfg = _cfg(path, "data.max_bad_fraction=0.1", f"data.prefetch={prefetch}")
    tok = tiny[1]
    for rank in (0, 1):
        steady = BatchBuilder.from_config(cfg, tok, rank=rank)
        expected = _batches(steady, 24)  # past two epochs of the rank's ~30 records
        assert steady.bad_rows >= 3, "a refused record is in this rank's shard (the 2 unparsable lines: on all ranks)"
        again = BatchBuilder.from_config(cfg, tok, rank=rank)  # another replica reading the same rank
        assert _same(_batches(again, 24), expected)
        for stop in (3, 9):  # in the first epoch, in the second
            first = BatchBuilder.from_config(cfg, tok, rank=rank)
            assert _same(_batches(first, stop), expected[:stop])
            state = json.loads(json.dumps(first.state_dict()))
            first.close()
            resumed = BatchBuilder.from_config(cfg, tok, rank=rank)  # a new process: no cache of bad records
            resumed.load_state_dict(state)
            assert _same(_batches(resumed, 24 - stop), expected[stop:]), (rank, stop)
            resumed.close()
        steady.close()
    other = [BatchBuilder.from_config(cfg, tok, rank=r).source for r in (0, 1)]
    assert isinstance(other[0], JsonlSource) and isinstance(other[1], JsonlSource)
    shards = [{r.where for r in s.train_records} for s in other]
    assert not shards[0] & shards[1] and not {f"{path}:{k}" for k in (3, 25)} & (shards[0] | shards[1])
