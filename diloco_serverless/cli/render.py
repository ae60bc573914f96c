"""Rich renderings of run state: the ``diloco status`` table, ``diloco ls``, launch progress, summary.

Everything here is a pure function from the dataclasses in :mod:`diloco_serverless.launcher.status` (or
plain dicts) to rich renderables or strings; nothing reads the store.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from diloco_serverless.launcher.status import (
    FAILED,
    RUNNING,
    STALE,
    SUCCEEDED,
    RunStatus,
)

_STATE_STYLE = {SUCCEEDED: "green", FAILED: "bold red", RUNNING: "cyan", STALE: "yellow",
                "cancelled": "magenta", "pending": "dim"}


def fmt_bytes(n: float | None) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def fmt_duration(seconds: float | None) -> str:
    """``75`` -> ``"1m15s"``; ``3725`` -> ``"1h02m05s"``."""
    if seconds is None:
        return "-"
    s = int(max(0.0, seconds))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    if h:
        return f"{h}h{m:02d}m{sec:02d}s"
    return f"{m}m{sec:02d}s" if m else f"{sec}s"


def fmt_loss(loss: float | None) -> str:
    return "-" if loss is None else f"{loss:.4f}"


def fmt_usd(usd: float | None) -> str:
    return "-" if usd is None else f"${usd:,.2f}"


def _state(state: str) -> Text:
    return Text(state, style=_STATE_STYLE.get(state, ""))


def _round_of(status: RunStatus) -> str:
    done = status.round
    if done is None:
        return "-"
    return f"{done}/{status.rounds_total}" if status.rounds_total else str(done)


def replica_table(status: RunStatus) -> Table:
    """One row per replica: state, round, step, loss, heartbeat age, bytes moved, attempt."""
    table = Table(title=f"run {status.run_id}", title_justify="left")
    for col, justify in [("rank", "right"), ("state", "left"), ("round", "right"),
                         ("step", "right"), ("loss", "right"), ("heartbeat", "right"),
                         ("bytes moved", "right"), ("attempt", "right"), ("note", "left")]:
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for r in status.replicas:
        age = "-" if r.heartbeat_age_s is None else f"{fmt_duration(r.heartbeat_age_s)} ago"
        table.add_row(
            str(r.rank), _state(r.state), "-" if r.round is None else str(r.round),
            "-" if r.step is None else str(r.step), fmt_loss(r.loss), age,
            fmt_bytes(r.bytes_moved), "-" if r.attempt is None else str(r.attempt),
            (r.reason or "")[:80],
        )
    return table


def totals_line(status: RunStatus) -> str:
    """The run totals under the table, e.g. ``state running | round 3/10 | loss 4.2 | ...``."""
    gpu = f" ({status.gpu})" if status.gpu else ""
    parts = [
        f"state {status.state}", f"round {_round_of(status)}", f"loss {fmt_loss(status.loss)}",
        f"eval loss {fmt_loss(status.eval_loss)}", f"moved {fmt_bytes(status.bytes_moved)}",
        f"elapsed {fmt_duration(status.elapsed_s)}",
        f"est. spend {fmt_usd(status.est_usd)} on {status.executor or '?'}{gpu}",
    ]
    return " | ".join(parts)


def status_renderable(status: RunStatus) -> Group:
    """Table plus totals, and the model location once it exists."""
    items: list[Any] = [replica_table(status), Text(totals_line(status))]
    if status.final_url:
        items.append(Text(f"model: {status.final_url}", style="green"))
    return Group(*items)


def progress_line(status: RunStatus) -> str:
    """A one-line progress report for non-terminal output (CI logs, pipes)."""
    live = sum(r.state == RUNNING for r in status.replicas)
    return (f"[{fmt_duration(status.elapsed_s)}] round {_round_of(status)} | "
            f"loss {fmt_loss(status.loss)} | {live}/{len(status.replicas)} running | "
            f"moved {fmt_bytes(status.bytes_moved)}")


def summary_lines(status: RunStatus) -> list[str]:
    """The end-of-launch summary: outcome, final eval loss, wall time, bytes moved, model."""
    lines = [
        f"run {status.run_id} {status.state} after {fmt_duration(status.elapsed_s)}",
        f"  final eval loss : {fmt_loss(status.eval_loss)}",
        f"  final train loss: {fmt_loss(status.loss)} (compose_loss total, mean over replicas)",
        f"  rounds          : {_round_of(status)}",
        f"  bytes moved     : {fmt_bytes(status.bytes_moved)}",
        f"  est. spend      : {fmt_usd(status.est_usd)}",
        f"  model           : {status.final_url or '(no final model written)'}",
        f"  run             : {status.url}",
    ]
    for rank, reason in status.failures:
        lines.append(f"  rank {rank} failed: {reason}")
    return lines


def runs_table(rows: Iterable[Mapping[str, Any]], store_url: str) -> Table:
    """``diloco ls``: one row per run (dicts with run_id, created, executor, replicas, rounds, state)."""
    table = Table(title=f"runs under {store_url}", title_justify="left")
    for col in ("run id", "created", "executor", "replicas", "rounds", "state", "loss"):
        table.add_column(col)
    for row in rows:
        table.add_row(
            str(row.get("run_id", "?")), str(row.get("created", "-")),
            str(row.get("executor") or "-"), str(row.get("replicas", "-")),
            str(row.get("rounds", "-")), _state(str(row.get("state", "-"))),
            fmt_loss(row.get("loss")),
        )
    return table
