"""Fakes shared by test_cli.py and test_api.py (no tests here).

``FakeExecutor`` satisfies the ServerlessExecutor protocol without processes: ``launch_replicas``
writes what finished replicas would leave in the store (heartbeats, per-round metrics with eval
loss, logs, a final model), so status/ls/plot/summary read a realistic run in milliseconds.
"""

from __future__ import annotations

import hashlib
from typing import Any

from diloco_serverless.config import RUN_KEY_ENV
from diloco_serverless.run.final import FINAL_DONE, done_bytes
from diloco_serverless.run.layout import log_key
from diloco_serverless.run.members import Heartbeat, write_heartbeat, write_metrics
from diloco_serverless.run.record import load_run


def write_final(store: Any, files: dict[str, bytes], run_key_hex: str | None) -> None:
    """Put ``files`` (key under final/ -> bytes) and the signed final/DONE.json listing them, as write_final does."""
    for key, data in files.items():
        store.put(key, data)
    key = bytes.fromhex(run_key_hex) if run_key_hex else None
    store.put(FINAL_DONE, done_bytes(key, {k: hashlib.sha256(v).hexdigest() for k, v in files.items()}, rank=0))


def simulate_replicas(run_url: str, n: int, rounds: int, *, fail_ranks: tuple[int, ...] = (),
                      finish: bool = True, run_key_hex: str | None = None) -> None:
    """Write heartbeats, metrics, logs and (if finish) final/ as N replicas of ``rounds`` rounds would."""
    store, _ = load_run(run_url)
    for rank in range(n):
        for rnd in range(rounds):
            loss = 5.0 - 0.5 * rnd - 0.05 * rank
            metrics: dict[str, Any] = {"step": (rnd + 1) * 4, "loss": loss, "bytes_up": 1000, "bytes_down": 1500}
            if rank == 0:
                metrics["eval_loss"] = loss + 0.2
            write_metrics(store, rank, rnd, metrics)
        failed = rank in fail_ranks
        state = "failed" if failed else ("done" if finish else "training")
        write_heartbeat(store, Heartbeat(rank=rank, round=rounds, step=rounds * 4, loss=5.0 - 0.5 * (rounds - 1),
                                         state=state, bytes_up=1000 * rounds, bytes_down=1500 * rounds,
                                         message="boom: simulated crash" if failed else None))
        store.put(log_key(rank), "".join(f"rank {rank} line {i}\n" for i in range(20)).encode())
    if finish and not fail_ranks:
        write_final(store, {"final/model.safetensors": b"not really a model", "final/config.json": b"{}"},
                    run_key_hex)


class FakeExecutor:
    """In-process ServerlessExecutor; states are scripted through ``finish`` / ``fail_ranks``."""

    def __init__(self, *, kind: str = "local", rounds: int = 3, finish: bool = True,
                 fail_ranks: tuple[int, ...] = (), usd_per_replica_hour: float | None = None) -> None:
        self.kind = kind
        self.rounds = rounds
        self.finish = finish
        self.fail_ranks = fail_ranks
        if usd_per_replica_hour is not None:
            self.usd_per_replica_hour = usd_per_replica_hour
        self.launched: list[dict[str, Any]] = []
        self.cancelled: list[list[dict[str, Any]]] = []

    def launch_replicas(self, n_replicas: int, entrypoint: str, entrypoint_args: list[str],
                        env: dict[str, str] | None = None) -> list[dict[str, Any]]:
        env = env or {}
        self.launched.append({"n": n_replicas, "entrypoint": entrypoint, "args": entrypoint_args, "env": env})
        simulate_replicas(env["DILOCO_RUN_URL"], n_replicas, self.rounds, fail_ranks=self.fail_ranks,
                          finish=self.finish, run_key_hex=env.get(RUN_KEY_ENV))
        return [{"kind": self.kind, "rank": r, "job": f"fake-{r}"} for r in range(n_replicas)]

    def poll(self, handles: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out = []
        for h in handles:
            if self.cancelled:
                out.append({"rank": h["rank"], "state": "cancelled"})
            elif h["rank"] in self.fail_ranks:
                out.append({"rank": h["rank"], "state": "failed", "reason": "exit code 3"})
            else:
                out.append({"rank": h["rank"], "state": "succeeded" if self.finish else "running"})
        return out

    def cancel(self, handles: list[dict[str, Any]]) -> None:
        self.cancelled.append(list(handles))

    def logs(self, handle: dict[str, Any], tail: int | None = None) -> str | None:
        return None  # the store's logs/rank-<r>.log is used instead


def use_fake_executor(monkeypatch: Any, ex: Any) -> None:
    """Make every executor the launcher builds (for launch, or from run.json) ``ex``."""
    from diloco_serverless.launcher import api, preflight

    monkeypatch.setattr(preflight, "build_executor", lambda kind, gpu, options: ex)
    monkeypatch.setattr(api, "executor_from_launch", lambda launch, run_url=None: (ex, None))
