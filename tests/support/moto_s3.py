"""A moto S3 server on 127.0.0.1 that behaves like S3 for create-only writes: the one behind the test
suite's ``s3_server`` fixture (tests/conftest.py) and the chaos and store benchmarks.

::

    with moto_server() as endpoint:          # "http://127.0.0.1:<free port>"
        ...                                  # boto3 / s3fs with endpoint_url=endpoint, dummy credentials
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["free_port", "make_moto_conditional_puts_atomic", "moto_server"]


def make_moto_conditional_puts_atomic() -> None:
    """moto checks ``If-None-Match: *`` and then stores the key without a lock, so two
    concurrent conditional writes can both succeed; real S3 is atomic. Serialise PutObject and
    the POSTs that complete multipart uploads so the server behaves like S3 (the header is
    still evaluated by moto itself). Idempotent."""
    from moto.s3.responses import S3Response

    if getattr(S3Response.put_object, "_diloco_locked", False):
        return
    lock = threading.RLock()

    def locked(original: Any) -> Any:
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            with lock:
                return original(self, *args, **kwargs)

        method._diloco_locked = True  # type: ignore[attr-defined]
        return method

    S3Response.put_object = locked(S3Response.put_object)  # type: ignore[method-assign]
    S3Response._key_response_post = locked(S3Response._key_response_post)  # type: ignore[method-assign]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """Start a moto S3 server on a free port of 127.0.0.1 (create-only PUTs atomic, see
    :func:`make_moto_conditional_puts_atomic`; werkzeug's per-request log lines silenced); yields
    its endpoint URL and stops it on exit."""
    from moto.server import ThreadedMotoServer

    make_moto_conditional_puts_atomic()
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()
