"""A 'container' of the fake Modal server (tests/support/modal_grpc_server.py) running one input.

``python modal_container.py <folder>``: ``<folder>/function`` holds the function as Modal serialised it
(``serialized=True``), ``<folder>/args`` the input's ``(args, kwargs)``. The input's ids are this
process's current input (``FAKE_MODAL_INPUT_ID`` / ``FAKE_MODAL_CALL_ID``), as Modal's container
runtime sets them, so a call spawned here is the input's child. Writes ``<folder>/result``:
``ok\\n<serialised value>`` or ``err\\n<serialised exception>``. Test support only: it unpickles what
the test's own process serialised.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def main() -> None:
    folder = Path(sys.argv[1])
    from modal._runtime.execution_context import _set_current_context_ids
    from modal._serialization import deserialize, serialize

    function = deserialize((folder / "function").read_bytes(), None)
    args, kwargs = deserialize((folder / "args").read_bytes(), None)
    _set_current_context_ids([os.environ["FAKE_MODAL_INPUT_ID"]], [os.environ["FAKE_MODAL_CALL_ID"]], [""])
    try:
        value = function(*args, **kwargs)
    except Exception as exc:
        (folder / "result").write_bytes(b"err\n" + serialize(exc))
    else:
        (folder / "result").write_bytes(b"ok\n" + serialize(value))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
