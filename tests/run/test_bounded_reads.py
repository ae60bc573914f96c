"""Finding 12: control objects are read with a per-kind size bound, never whole."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diloco_serverless.exchange._io import CONTROL_MAX_BYTES, QUORUM_MAX_BYTES, CountingStore
from diloco_serverless.exchange.errors import CorruptObjectError
from diloco_serverless.run.bounded import LIMITS
from diloco_serverless.run.layout import abstain_key, member_key, quorum_key, ready_key, vote_key
from diloco_serverless.run.members import Heartbeat, read_members, write_heartbeat
from diloco_serverless.run.record import InvalidRun, load_run
from diloco_serverless.store.objectstore import ObjectStore


class Counting(ObjectStore):
    """Records how many bytes each GET returned."""

    reads: list[tuple[str, int]]

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        data = super().get(key, max_bytes=max_bytes)
        self.reads.append((key, len(data)))
        return data


@pytest.mark.parametrize("key,limit", [
    (ready_key(0, 1, "ab"), CONTROL_MAX_BYTES), (abstain_key(0, 1), CONTROL_MAX_BYTES),
    (vote_key(0, 1), CONTROL_MAX_BYTES), (quorum_key(0), QUORUM_MAX_BYTES),
], ids=["ready", "abstain", "vote", "quorum"])
def test_an_oversized_round_control_object_is_refused_unread(tmp_path: Path, key: str, limit: int) -> None:
    store = ObjectStore(tmp_path.as_uri())
    store.put(key, b"{" + b" " * (limit + 10) + b"}")
    io = CountingStore(store)
    with pytest.raises(CorruptObjectError, match="larger than"):
        io.get(key)
    assert io.bytes_down == 0


def test_an_oversized_heartbeat_is_skipped_and_run_json_refused(tmp_path: Path) -> None:
    store = Counting(tmp_path.as_uri())
    store.reads = []
    write_heartbeat(store, Heartbeat(rank=0, round=1, step=4, state="training"))
    store.put(member_key(1), json.dumps({"rank": 1, "message": "x" * (2 << 20)}).encode())
    with pytest.warns(UserWarning, match="larger than"):
        members = read_members(store)
    assert set(members) == {0}
    store.put("run.json", b" " * (LIMITS["run.json"] + 1))
    with pytest.raises(InvalidRun, match="larger than"):
        load_run(store)
    assert max(n for _, n in store.reads) <= LIMITS["run.json"] + 1
