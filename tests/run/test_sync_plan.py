"""Plans of H (inner.sync_every = "auto"): signed, bound to their round, create-only, waited for."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from diloco_serverless.run.integrity import mac_json
from diloco_serverless.run.layout import sync_plan_key
from diloco_serverless.run.sync_plan import (
    PLAN_KIND,
    PlanRefused,
    PlanTimeout,
    RoundPlan,
    latest_plan,
    read_plan,
    wait_plan,
    write_plan,
)
from diloco_serverless.store.objectstore import ObjectStore

KEY = b"k" * 32


@pytest.fixture
def store(tmp_path: Path) -> ObjectStore:
    return ObjectStore(f"file://{tmp_path}/run")


def test_a_plan_round_trips_and_the_first_writer_wins(store: ObjectStore) -> None:
    plan = RoundPlan(3, 12, 40, reason="drift", compute_s=0.1, exchange_s=0.9)
    assert write_plan(store, plan, KEY) == plan
    assert read_plan(store, 3, KEY) == plan
    # a later writer (a restarted rank 0, a replica keeping H while rank 0 is away) gets the stored plan
    assert write_plan(store, RoundPlan(3, 4, 40), KEY) == plan
    assert read_plan(store, 4, KEY) is None
    assert latest_plan(store, KEY) == plan
    assert plan.end == 52


def _put(store: ObjectStore, round_: int, doc: dict) -> None:
    store.put(sync_plan_key(round_), json.dumps(doc).encode())


@pytest.mark.parametrize("how", ["unsigned", "forged", "other round", "wrong key"])
def test_a_plan_that_does_not_verify_is_refused(store: ObjectStore, how: str) -> None:
    doc = {"round": 2, "h": 8, "start": 16, "last": False, "reason": "kept", "compute_s": None, "exchange_s": None}
    if how == "forged":
        doc = {**mac_json(KEY, PLAN_KIND, doc, place=sync_plan_key(2)), "h": 64}
    elif how == "other round":  # a genuine plan of round 1 copied to round 2's key
        doc = mac_json(KEY, PLAN_KIND, {**doc, "round": 1}, place=sync_plan_key(1))
    elif how == "wrong key":
        doc = mac_json(b"x" * 32, PLAN_KIND, doc, place=sync_plan_key(2))
    _put(store, 2, doc)
    with pytest.raises(PlanRefused, match="does not verify"):
        read_plan(store, 2, KEY)
    with pytest.raises(PlanRefused):
        wait_plan(store, 2, KEY, timeout_s=0.1)
    assert latest_plan(store, KEY) is None  # status shows nothing rather than a forged H


@pytest.mark.parametrize("doc", [[1, 2], {"round": 2, "h": 0, "start": 0}, {"round": 2, "h": "8", "start": 0},
                                 {"round": 2, "h": 8, "start": 0, "extra": 1}, {"round": 5, "h": 8, "start": 0}])
def test_a_malformed_plan_is_refused_even_without_a_key(store: ObjectStore, doc: object) -> None:
    store.put(sync_plan_key(2), json.dumps(doc).encode())
    with pytest.raises(PlanRefused):
        read_plan(store, 2, None)


def test_waiting_for_a_plan_returns_once_it_is_stored_and_times_out_otherwise(store: ObjectStore) -> None:
    with pytest.raises(PlanTimeout, match="rank 0 has not decided H of round 0"):
        wait_plan(store, 0, KEY, timeout_s=0.1, poll_s=0.02)
    later = threading.Timer(0.2, write_plan, (store, RoundPlan(0, 8, 0), KEY))
    later.start()
    start = time.monotonic()
    assert wait_plan(store, 0, KEY, timeout_s=10, poll_s=0.02) == RoundPlan(0, 8, 0)
    assert time.monotonic() - start < 5
    later.join()
