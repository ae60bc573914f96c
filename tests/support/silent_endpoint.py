"""A TCP endpoint that accepts connections and never answers: the worst store a client can meet."""

from __future__ import annotations

import socket
import threading
import time


class SilentEndpoint:
    """A TCP server on 127.0.0.1 that accepts every connection, reads what it is sent and never
    answers. Its thread stops on :meth:`close` or by itself after ``lifetime_s``, closing every
    connection."""

    def __init__(self, lifetime_s: float = 120.0) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self._sock.settimeout(0.1)
        self.port = int(self._sock.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.accepted = 0
        self._conns: list[socket.socket] = []
        self._stop = threading.Event()
        self._until = time.monotonic() + lifetime_s
        self._thread = threading.Thread(target=self._serve, name="silent-endpoint", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            while not self._stop.is_set() and time.monotonic() < self._until:
                try:
                    conn, _ = self._sock.accept()
                    conn.setblocking(False)
                    self._conns.append(conn)
                    self.accepted += 1
                except TimeoutError:  # no new connection this tick
                    pass
                except OSError:
                    break
                for conn in list(self._conns):  # read and drop requests; answer nothing
                    try:
                        conn.recv(65536)
                    except OSError:
                        pass
        finally:
            for conn in self._conns:
                conn.close()
            self._sock.close()

    def wait_accepted(self, timeout_s: float = 5.0) -> int:
        """The connections accepted so far, waiting up to ``timeout_s`` for a first one: a client's
        connection can sit in the listen backlog for a moment before this thread accepts it."""
        until = time.monotonic() + timeout_s
        while self.accepted == 0 and time.monotonic() < until and self._thread.is_alive():
            time.sleep(0.02)
        return self.accepted

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
