"""Stand-in for one local process of a multi-device replica (tests of entrypoints/local_group.py).

Writes its pid and environment to ``$LOCAL_CHILD_DIR/<LOCAL_RANK>.json``, waits until every
sibling has written its own, then behaves as ``$LOCAL_CHILD_PLAN`` says for its local rank
(comma-separated, one entry per rank): ``ok`` exits 0, ``exit<N>`` exits N, ``hang`` sleeps until
killed.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main() -> int:
    rank = int(os.environ["LOCAL_RANK"])
    keys = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DILOCO_DEVICE")
    record = {"pid": os.getpid(), "argv": sys.argv[1:], **{k: os.environ.get(k) for k in keys}}
    tmp = Path(os.environ["LOCAL_CHILD_DIR"]) / f".{rank}.tmp"
    tmp.write_text(json.dumps(record))
    tmp.rename(tmp.with_name(f"{rank}.json"))  # whole, or not there
    folder, size = Path(os.environ["LOCAL_CHILD_DIR"]), int(os.environ["LOCAL_WORLD_SIZE"])
    deadline = time.monotonic() + 60  # act once every sibling has started (and written its record)
    while len(list(folder.glob("*.json"))) < size and time.monotonic() < deadline:
        time.sleep(0.02)
    what = os.environ["LOCAL_CHILD_PLAN"].split(",")[rank]
    if what == "hang":
        while True:
            time.sleep(1)
    return 0 if what == "ok" else int(what.removeprefix("exit"))


if __name__ == "__main__":
    sys.exit(main())
