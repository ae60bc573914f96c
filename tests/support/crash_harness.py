"""Two replicas of a run in threads, rank 1 'killed' once mid-run and started again from the store.

Shared by the exact-resume tests of plain rounds (tests/trainer/test_train.py), one-step-delay rounds
(test_outer_delay.py) and auto-H rounds (test_auto_sync.py): rank 1 raises ``KeyboardInterrupt`` (a
stand-in for SIGKILL) at its ``crash_at_call``-th loss, its manager is shut down without waiting, and
a fresh :class:`ReplicaTrainer` of the next attempt resumes from the store, as the executor's
supervisor would.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from diloco_serverless.trainer import loop
from diloco_serverless.trainer.loop import ReplicaTrainer


def run_two_with_crash(url: str, crash_at_call: int | None, monkeypatch: pytest.MonkeyPatch, *,
                       slow_rank: int | None = None, slow_s: float = 0.03) -> dict[int, ReplicaTrainer]:
    """Train ranks 0 and 1 of the run at ``url`` to the end; rank 1 dies at its ``crash_at_call``-th loss
    (None: never) and ``slow_rank`` sleeps ``slow_s`` per loss. Returns each rank's last trainer; an
    error in either thread is raised here."""
    who = threading.local()
    real = loop.compose_loss
    calls = {0: 0, 1: 0}

    def wrapped(model: torch.nn.Module, batch: dict, **kw: object):  # type: ignore[no-untyped-def]
        rank = getattr(who, "rank", 0)
        calls[rank] += 1
        if rank == slow_rank:
            time.sleep(slow_s)
        if rank == 1 and calls[rank] == crash_at_call:
            raise KeyboardInterrupt("simulated SIGKILL of rank 1")
        return real(model, batch, **kw)

    monkeypatch.setattr(loop, "compose_loss", wrapped)
    out: dict[int, ReplicaTrainer] = {}
    errors: list[BaseException] = []

    def work(rank: int) -> None:
        who.rank = rank
        try:
            for attempt in range(2):
                trainer = ReplicaTrainer.from_run(url, rank, attempt=attempt)
                try:
                    trainer.run()
                except KeyboardInterrupt:
                    trainer.manager.shutdown(wait=False)
                    continue
                out[rank] = trainer
                return
        except BaseException as exc:  # surfaced in the test's thread below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    if errors:
        raise errors[0]
    assert set(out) == {0, 1}, f"ranks that finished: {sorted(out)}"
    return out
