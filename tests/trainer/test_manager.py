"""ObjectStoreManager / MockManager follow torchft.Manager's semantics (as used by DiLoCo)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from torch.distributed import ReduceOp

from diloco_serverless.testing import MockGroup, MockManager
from diloco_serverless.trainer.manager import ObjectStoreManager


def _exchange(manager: MockManager | ObjectStoreManager, value: torch.Tensor,
              reduce_op: ReduceOp.RedOpType = ReduceOp.AVG) -> tuple[torch.Tensor, bool]:
    manager.start_quorum()
    t = value.clone()
    manager.allreduce(t, reduce_op=reduce_op).wait()
    return t, manager.should_commit()


def _in_threads(fn, world: int) -> list:
    out: list = [None] * world
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            out[rank] = fn(rank)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    if errors:
        raise errors[0]
    return out


def test_mock_average_sum_step_and_participants() -> None:
    group = MockGroup(2)

    def body(rank: int) -> tuple:
        m = MockManager(group, rank)
        avg, ok1 = _exchange(m, torch.full((5,), float(rank + 1)))
        total, ok2 = _exchange(m, torch.full((5,), float(rank + 1)), ReduceOp.SUM)
        res = (avg, total, ok1, ok2, m.current_step(), m.num_participants(), m.is_participating(),
               m.batches_committed())
        m.shutdown()
        return res

    for avg, total, ok1, ok2, step, n, part, batches in _in_threads(body, 2):
        assert torch.equal(avg, torch.full((5,), 1.5)) and torch.equal(total, torch.full((5,), 3.0))
        assert ok1 and ok2 and step == 2 and n == 2 and part and batches == 4


def test_error_is_reported_not_raised_and_blocks_commit() -> None:
    m = MockManager(MockGroup(1), 0, fail_rounds={0}, max_retries=1)
    t, ok = _exchange(m, torch.ones(4))
    assert not ok and m.current_step() == 0
    assert isinstance(m.errored(), ConnectionError)
    assert torch.equal(t, torch.zeros(4)), "a failed exchange zeroes the buffer (torchft semantics)"
    # while errored, further allreduces are no-ops; start_quorum clears the error
    dummy = torch.ones(2)
    m.allreduce(dummy).wait()
    assert torch.equal(dummy, torch.ones(2))
    t, ok = _exchange(m, torch.ones(4))
    assert ok and m.errored() is None and m.current_step() == 1 and torch.equal(t, torch.ones(4))
    m.shutdown()


def test_max_retries_raises_after_consecutive_failures() -> None:
    m = MockManager(MockGroup(1), 0, fail_rounds={0}, max_retries=0)
    m.start_quorum()
    m.allreduce(torch.ones(2)).wait()
    with pytest.raises(RuntimeError, match="max_retries=0"):
        m.should_commit()
    m.shutdown()


def test_min_replicas_blocks_commit_when_too_few_participate() -> None:
    group = MockGroup(2)
    group.leave(1)
    m = MockManager(group, 0, min_replicas=2)
    _, ok = _exchange(m, torch.ones(3))
    assert not ok and m.num_participants() == 1 and m.current_step() == 0
    m.shutdown()


def test_late_replica_receives_mean_but_is_not_participating() -> None:
    group = MockGroup(2)

    def body(rank: int) -> tuple:
        m = MockManager(group, rank, drop_rounds={0} if rank == 1 else None)
        t, ok = _exchange(m, torch.full((3,), float(rank)))
        res = (t, ok, m.is_participating(), m.num_participants())
        m.shutdown()
        return res

    (t0, ok0, p0, n0), (t1, ok1, p1, n1) = _in_threads(body, 2)
    assert torch.equal(t0, t1) and torch.equal(t0, torch.zeros(3))
    assert ok0 and ok1 and p0 and not p1 and n0 == n1 == 1


def test_future_callbacks_run_before_wait_returns() -> None:
    m = MockManager(MockGroup(1), 0)
    m.start_quorum()
    t = torch.ones(1000)
    out = torch.zeros(1000)
    work = m.allreduce(t)
    work.get_future().then(lambda _f: out.copy_(t * 2))
    work.wait()
    assert torch.equal(out, torch.full((1000,), 2.0))
    m.shutdown()


def test_state_dict_fns_and_replay() -> None:
    group = MockGroup(1)
    m = MockManager(group, 0)
    box = {"w": torch.arange(3.0)}
    m.register_state_dict_fn("box", lambda sd: box.update(w=sd["w"].clone()), lambda: {"w": box["w"]})
    _exchange(m, torch.full((2,), 5.0))
    state = m.manager_state_dict()
    assert state["torchft"] == {"step": 1, "batches_committed": 1}
    m2 = MockManager(group, 0)
    m2.register_state_dict_fn("box", lambda sd: box.update(w=sd["w"] + 1), lambda: box)
    m2.load_manager_state_dict({"user": {"box": {"w": torch.zeros(3)}}, "torchft": {"step": 0, "batches_committed": 0}})
    assert m2.current_step() == 0 and torch.equal(box["w"], torch.ones(3))
    with m2.replaying():
        t, ok = _exchange(m2, torch.zeros(2))
    assert ok and torch.equal(t, torch.full((2,), 5.0)) and m2.history[-1].replayed
    m.shutdown()
    m2.shutdown()


def test_invalid_arguments_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="rank 4 is outside the run"):
        ObjectStoreManager(f"file://{tmp_path}", 4, 4, run_id="r")
    with pytest.raises(ValueError, match="min_replicas"):
        MockManager(MockGroup(2), 0, min_replicas=3)
    m = MockManager(MockGroup(1), 0)
    with pytest.raises(ValueError, match="not supported"):
        m.allreduce(torch.ones(1), reduce_op=ReduceOp.MAX)
    m.shutdown()


def test_object_store_partial_quorum_then_late_replica(tmp_path: Path) -> None:
    """Rank 1 misses the straggler deadline: rank 0 commits alone, rank 1 adopts the same result."""
    url = f"file://{tmp_path}"
    kw = dict(run_id="late", min_replicas=1, straggler_timeout_s=0.3, timeout_s=30.0, poll_interval_s=0.02)
    m0 = ObjectStoreManager(url, 0, 2, **kw)  # type: ignore[arg-type]
    m1 = ObjectStoreManager(url, 1, 2, **kw)  # type: ignore[arg-type]
    t0, ok0 = _exchange(m0, torch.full((10,), 2.0))
    assert ok0 and m0.num_participants() == 1 and m0.history[0].bytes_up > 0
    t1, ok1 = _exchange(m1, torch.full((10,), 4.0))
    assert ok1 and torch.equal(t0, t1) and torch.equal(t1, torch.full((10,), 2.0))
    assert not m1.is_participating() and m1.history[0].late
    assert m1.read_reduced(0, torch.zeros(10)) is not None
    m0.prune(1)
    assert m1.read_reduced(0, torch.zeros(10)) is None
    m0.shutdown()
    m1.shutdown()


def test_object_store_single_replica_touches_no_store(tmp_path: Path) -> None:
    m = ObjectStoreManager(f"file://{tmp_path}/nothing", 0, 1, run_id="solo")
    t, ok = _exchange(m, torch.full((4,), 3.0))
    assert ok and torch.equal(t, torch.full((4,), 3.0)) and not (tmp_path / "nothing").exists()
    m.shutdown()
