"""A run's folder in the store: its key layout, the ``run.json`` record, heartbeats and metrics.

No torch here: the launcher, the CLI and the replicas all read a run through this package.
:mod:`.layout` builds every key a run writes; :mod:`.record` creates, loads and lists runs;
:mod:`.members` holds what each replica reports while it runs. See docs/architecture.md.
"""

from __future__ import annotations

from diloco_serverless.run.layout import FINAL_PREFIX, RUN_JSON, RUN_VERSION
from diloco_serverless.run.members import (
    HEARTBEAT_STATES,
    Heartbeat,
    read_members,
    read_metrics,
    write_heartbeat,
    write_metrics,
)
from diloco_serverless.run.record import (
    InvalidRun,
    RunExists,
    RunNotFound,
    RunRecord,
    create_run,
    join_run_url,
    list_runs,
    load_run,
    open_run_store,
    record_launch,
    split_run_url,
)

__all__ = [
    "FINAL_PREFIX",
    "HEARTBEAT_STATES",
    "RUN_JSON",
    "RUN_VERSION",
    "Heartbeat",
    "InvalidRun",
    "RunExists",
    "RunNotFound",
    "RunRecord",
    "create_run",
    "join_run_url",
    "list_runs",
    "load_run",
    "open_run_store",
    "read_members",
    "read_metrics",
    "record_launch",
    "split_run_url",
    "write_heartbeat",
    "write_metrics",
]
