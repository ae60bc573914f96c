"""A stand-in replica that stops "before its deadline": ``python -m support.continue_replica``.

Prints ``continue replica rank=<r> attempt=<a> timeout=<DILOCO_ATTEMPT_TIMEOUT_S or None>
deadline=<DILOCO_ATTEMPT_DEADLINE or None>``, then exits with CONTINUE_EXIT_CODE (75) while
``DILOCO_ATTEMPT`` < ``$FAKE_CONTINUE_ATTEMPTS`` (default 0), else 0.
"""

from __future__ import annotations

import os
import sys

from diloco_serverless.executors.base import ATTEMPT_DEADLINE_ENV, ATTEMPT_TIMEOUT_ENV, CONTINUE_EXIT_CODE


def main() -> int:
    rank = int(os.environ["REPLICA_RANK"])
    attempt = int(os.environ.get("DILOCO_ATTEMPT", "0"))
    timeout = os.environ.get(ATTEMPT_TIMEOUT_ENV)
    deadline = os.environ.get(ATTEMPT_DEADLINE_ENV)
    print(f"continue replica rank={rank} attempt={attempt} timeout={timeout} deadline={deadline}", flush=True)
    if attempt < int(os.environ.get("FAKE_CONTINUE_ATTEMPTS", "0")):
        print(f"rank {rank} attempt {attempt}: state saved, continuing", flush=True)
        return CONTINUE_EXIT_CODE
    print(f"rank {rank} done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
