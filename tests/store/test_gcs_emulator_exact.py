"""The test GCS emulator stores exactly the bytes uploaded (tests/conftest.py fixes its multipart parsing)."""

from __future__ import annotations

import os
from typing import Any

import pytest

from diloco_serverless.store.objectstore import ObjectStore


@pytest.mark.parametrize("tail", [b"\r", b"\n", b"\r\n", b"\n\n", b"x"])
def test_an_object_ending_in_a_line_end_keeps_it(gcs_store_url: str, gcs_storage_options: dict[str, Any],
                                                 tail: bytes) -> None:
    store = ObjectStore(gcs_store_url, gcs_storage_options)
    data = os.urandom(99) + tail
    store.put("k", data)
    assert store.get("k") == data
