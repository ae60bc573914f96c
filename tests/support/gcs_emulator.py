"""gcp-storage-emulator (in memory) on 127.0.0.1, as a context manager yielding its endpoint URL.

Used by the test fixtures (tests/conftest.py, which also instruments it) and the GCS benchmark.
Point gcsfs at it with ``{"endpoint_url": endpoint, "token": "anon"}``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from support.moto_s3 import free_port


@contextmanager
def gcs_emulator() -> Iterator[str]:
    """Start the emulator on a free 127.0.0.1 port; stop it on exit."""
    from gcp_storage_emulator import server as gserver

    port = free_port()
    server = gserver.create_server("127.0.0.1", port, in_memory=True)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()
