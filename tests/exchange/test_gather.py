"""ReducedShards (diloco_serverless.exchange.gather): the gather keeps listing while downloads run."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

from diloco_serverless.exchange._io import CountingStore
from diloco_serverless.exchange.gather import ReducedShards
from diloco_serverless.run.layout import reduced_key, reduced_prefix
from diloco_serverless.store.objectstore import ObjectStore


class HeldStore(ObjectStore):
    """A memory store whose GETs of ``held`` keys wait until ``release`` is set; counts listings and GETs."""

    def __init__(self, held: set[str]) -> None:
        super().__init__(f"memory://gather-{uuid.uuid4().hex[:8]}")
        self.held, self.release = held, threading.Event()
        self.lists, self.gets = 0, []

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        self.gets.append(key)
        if key in self.held:
            assert self.release.wait(10), "the test never released the held GET"
        return super().get(key, max_bytes=max_bytes)

    def list(self, prefix: str = "") -> list[str]:
        self.lists += 1
        return super().list(prefix)


def _shards(
    store: ObjectStore, n: int, *, listing: bool, budget: int = 1 << 20
) -> tuple[ReducedShards, dict[int, str]]:
    keys = {j: reduced_key(0, j) for j in range(n)}
    return ReducedShards(CountingStore(store), keys, dict.fromkeys(keys, 100),
                         reduced_prefix(0) if listing else None, budget), keys


def _poll_until(fetch: ReducedShards, todo: set[int], got: dict[int, bytes], want: set[int]) -> None:
    deadline = time.monotonic() + 10
    while not want <= set(got):
        assert time.monotonic() < deadline, f"only {sorted(got)} arrived"
        fetch.poll(todo - set(got), got.__setitem__)
        fetch.wait(0.01)


def test_a_slow_download_does_not_hold_up_the_shards_that_appear_after_it() -> None:
    store = HeldStore({reduced_key(0, 0)})
    fetch, keys = _shards(store, 2, listing=True)
    store.put(keys[0], b"zero")
    got: dict[int, bytes] = {}
    assert fetch.poll({0, 1}, got.__setitem__)  # shard 0 listed: its download starts (and hangs)
    assert fetch.in_flight() == {0}
    store.put(keys[1], b"one")  # written while shard 0 is still downloading
    _poll_until(fetch, {0, 1}, got, {1})
    assert got == {1: b"one"} and fetch.in_flight() == {0}
    store.release.set()
    _poll_until(fetch, {0, 1}, got, {0, 1})
    assert got == {0: b"zero", 1: b"one"}
    assert store.gets.count(keys[0]) == 1 and store.gets.count(keys[1]) == 1  # each fetched once
    assert store.lists >= 2


def test_unlisted_rounds_ask_again_for_a_shard_that_was_missing() -> None:
    store = HeldStore(set())
    fetch, keys = _shards(store, 2, listing=False)
    store.put(keys[0], b"zero")
    got: dict[int, bytes] = {}
    _poll_until(fetch, {0, 1}, got, {0})
    assert 1 not in got and store.lists == 0
    store.put(keys[1], b"one")
    _poll_until(fetch, {0, 1}, got, {0, 1})
    assert got[1] == b"one" and store.gets.count(keys[1]) >= 2 and store.gets.count(keys[0]) == 1


def test_downloads_in_flight_stay_within_the_byte_budget() -> None:
    keys_held = {reduced_key(0, j) for j in range(4)}
    store = HeldStore(keys_held)
    fetch, keys = _shards(store, 4, listing=True, budget=250)  # 100 bytes a shard: two at a time
    for j in range(4):
        store.put(keys[j], bytes([j]))
    got: dict[int, Any] = {}
    fetch.poll(set(range(4)), got.__setitem__)
    assert fetch.in_flight() == {0, 1}
    store.release.set()
    _poll_until(fetch, set(range(4)), got, set(range(4)))
    assert got == {j: bytes([j]) for j in range(4)}
