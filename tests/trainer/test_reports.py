"""The background writer of a replica's heartbeats and metrics (trainer/reports.py): the training never
waits for a report's PUT, reports are written in order, a newer heartbeat replaces a queued one, metrics
are never dropped, a failed write is counted and logged (not raised), and flush / close wait for what
was handed over."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest

from diloco_serverless.errors import StoreError
from diloco_serverless.store.objectstore import ObjectStore
from diloco_serverless.trainer.reports import ReportWriter

HB = "members/rank-3.json"


class GatedStore(ObjectStore):
    """A file store whose puts wait until :attr:`gate` is set, recording the keys in write order; keys
    in :attr:`failing` raise StoreError instead."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.gate = threading.Event()
        self.entered = threading.Event()  # a put is waiting at the gate
        self.order: list[tuple[str, bytes]] = []
        self.failing: set[str] = set()

    def put(self, key: str, data: bytes) -> None:
        self.entered.set()
        assert self.gate.wait(10), "the test never opened the gate"
        if key in self.failing:
            raise StoreError(f"{key}: the store refused the write (test)")
        super().put(key, data)
        self.order.append((key, data))


@pytest.fixture
def store(tmp_path: Path) -> GatedStore:
    return GatedStore(f"file://{tmp_path / 'store'}")


def test_put_returns_while_the_store_is_still_writing_and_everything_lands_in_order(store: GatedStore) -> None:
    writer = ReportWriter(store, HB)
    writer.put("metrics/rank-3/00000000.json", b"m0")
    assert store.entered.wait(5)  # the writer thread is inside the store's put, blocked
    writer.put(HB, b"hb-1")
    writer.put("metrics/rank-3/00000001.json", b"m1")  # the caller never waited
    assert writer.pending() == 3 and store.order == []
    assert writer.flush(timeout_s=0.2) is False  # still blocked: flush says so instead of hanging
    store.gate.set()
    assert writer.flush(timeout_s=10)
    assert store.order == [("metrics/rank-3/00000000.json", b"m0"), (HB, b"hb-1"),
                           ("metrics/rank-3/00000001.json", b"m1")]
    assert store.get(HB) == b"hb-1" and writer.pending() == 0 and writer.written == 3
    assert writer.close(timeout_s=5)


def test_a_newer_heartbeat_replaces_a_queued_one_but_metrics_are_never_dropped(store: GatedStore) -> None:
    writer = ReportWriter(store, HB)
    writer.put("metrics/rank-3/00000000.json", b"m0")
    assert store.entered.wait(5)
    for i in range(5):
        writer.put(HB, f"hb-{i}".encode())
        writer.put(f"metrics/rank-3/{i + 1:08d}.json", f"m{i + 1}".encode())
    store.gate.set()
    assert writer.close(timeout_s=10)
    heartbeats = [d for k, d in store.order if k == HB]
    metrics = [d for k, d in store.order if k != HB]
    assert heartbeats == [b"hb-4"]  # the four older ones were replaced while queued
    assert metrics == [b"m0", b"m1", b"m2", b"m3", b"m4", b"m5"]
    assert store.get(HB) == b"hb-4"


def test_a_failed_write_is_counted_and_logged_and_the_next_ones_still_land(
        store: GatedStore, caplog: pytest.LogCaptureFixture) -> None:
    store.failing = {"metrics/rank-3/00000001.json"}
    store.gate.set()
    writer = ReportWriter(store, HB)
    with caplog.at_level(logging.WARNING, logger="diloco_serverless.trainer.reports"):
        for i in range(3):
            writer.put(f"metrics/rank-3/{i:08d}.json", b"m")
        assert writer.close(timeout_s=10)
    assert writer.failures == 1 and writer.written == 2
    assert [k for k, _ in store.order] == ["metrics/rank-3/00000000.json", "metrics/rank-3/00000002.json"]
    assert "metrics/rank-3/00000001.json" in caplog.text and "refused" in caplog.text


def test_a_closed_writer_refuses_reports_and_its_thread_ends(store: GatedStore) -> None:
    store.gate.set()
    writer = ReportWriter(store, HB, name="reports-under-test")
    writer.put(HB, b"last")
    assert writer.close(timeout_s=10)
    assert store.get(HB) == b"last"
    assert not any(t.name == "reports-under-test" for t in threading.enumerate())
    with pytest.raises(RuntimeError, match="closed"):
        writer.put(HB, b"too late")


def test_a_close_that_times_out_keeps_writing_in_order_so_the_last_heartbeat_stays_last(store: GatedStore) -> None:
    """The trainer queues the heartbeat that ends an attempt and closes the writer. On a store slower than
    the close's timeout, an older heartbeat must never land after it."""
    writer = ReportWriter(store, HB)
    writer.put(HB, b"training")
    assert store.entered.wait(5)  # "training" is in flight, blocked
    writer.put("metrics/rank-3/00000007.json", b"m7")
    writer.put(HB, b"failed")
    assert writer.close(timeout_s=0.2) is False and writer.pending() == 3
    store.gate.set()
    assert writer.flush(timeout_s=10)
    assert store.order == [(HB, b"training"), ("metrics/rank-3/00000007.json", b"m7"), (HB, b"failed")]
    assert store.get(HB) == b"failed"
