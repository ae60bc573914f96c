"""Rich renderings of run state: the ``diloco status`` table, ``diloco ls``, launch progress, summary.

Everything here is a pure function from the dataclasses in :mod:`diloco_serverless.launcher.status` (or
plain dicts) to rich renderables or strings; nothing reads the store.

The terminal shows text, not markup: most of what is rendered came from the bucket (heartbeat
messages, run.json fields, folder names), which anyone with write access to the run can fill. Every
such string goes through :func:`plain` (control characters, ANSI/OSC escape sequences and bidi
overrides become visible ``\\xNN`` text) and reaches Rich as a ``Text`` object or escaped with
:func:`markup_safe`, so ``[/]`` or ``[link=...]`` is printed as written and never interpreted.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rich.console import Group
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from diloco_serverless.launcher.status import (
    CONTINUE,
    FAILED,
    RUNNING,
    STALE,
    STARTING,
    SUCCEEDED,
    RunStatus,
)
from diloco_serverless.run.rl_metrics import per_function

_STATE_STYLE = {SUCCEEDED: "green", FAILED: "bold red", RUNNING: "cyan", STALE: "yellow",
                "cancelled": "magenta", "pending": "dim", STARTING: "blue", CONTINUE: "yellow"}


#: C0/C1 control characters (ESC starts ANSI and OSC 8 hyperlink sequences), DEL, zero-width and
#: bidi formatting characters: nothing from the store may move the cursor or reorder what is shown.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")


def _visible(match: re.Match[str]) -> str:
    c = match.group()
    if c in "\t\n\r":
        return " "
    return f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}"


def plain(value: Any, limit: int | None = None) -> str:
    """``value`` as one line of inert text: control and formatting characters shown as ``\\xNN``/
    ``\\uNNNN``, line breaks and tabs as spaces, cut to ``limit`` characters (with "...")."""
    out = _UNSAFE.sub(_visible, value if isinstance(value, str) else str(value))
    if limit is not None and len(out) > limit:
        out = out[: max(0, limit - 3)] + "..."
    return out


def plain_lines(value: str) -> str:
    """Log text (``diloco logs``) as inert text: each line through :func:`plain` (terminal escapes, control
    and bidi characters shown as ``\\xNN``), the line breaks kept."""
    return "\n".join(plain(line) for line in value.split("\n"))


def markup_safe(value: Any, limit: int | None = None) -> str:
    """:func:`plain` then ``rich.markup.escape``: for a string Rich will parse as markup."""
    return escape(plain(value, limit))


def text(value: Any, style: str = "", limit: int | None = None) -> Text:
    """A Rich ``Text`` (never parsed as markup) of :func:`plain` ``value``."""
    return Text(plain(value, limit), style=style)


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
    if isinstance(loss, bool) or not isinstance(loss, (int, float)):
        return "-" if loss is None else "?"
    try:
        return f"{float(loss):.4f}"
    except OverflowError:  # an int too large for a float
        return "?"


def fmt_usd(usd: float | None) -> str:
    return "-" if usd is None else f"${usd:,.2f}"


def _state(state: Any) -> Text:
    return text(state, style=_STATE_STYLE.get(state, "") if isinstance(state, str) else "", limit=20)


def _field(r: Any, name: str, shown: str | None) -> str:
    """A table cell: the value, ``?`` when the heartbeat held something unusable there, else ``-``."""
    if shown is not None:
        return shown
    return "?" if name in getattr(r, "invalid", ()) else "-"


def _round_of(status: RunStatus) -> str:
    done = status.round
    if done is None:
        return "-"
    return f"{done}/{status.rounds_total}" if status.rounds_total else str(done)


def replica_table(status: RunStatus) -> Table:
    """One row per replica: state, round, step, loss, heartbeat age, bytes moved, attempts (starts of the
    rank's replica, from its start records; else the heartbeat's attempt number + 1)."""
    table = Table(title=text(f"run {status.run_id}"), title_justify="left")
    for col, justify in [("rank", "right"), ("state", "left"), ("round", "right"),
                         ("step", "right"), ("loss", "right"), ("heartbeat", "right"),
                         ("bytes moved", "right"), ("attempts", "right"), ("note", "left")]:
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for r in status.replicas:
        age = None if r.heartbeat_age_s is None else f"{fmt_duration(r.heartbeat_age_s)} ago"
        bad_bytes = {"bytes_up", "bytes_down"} & set(r.invalid)
        moved = "?" if bad_bytes else fmt_bytes(r.bytes_moved)
        table.add_row(
            text(r.rank), _state(r.state),
            text(_field(r, "round", None if r.round is None else str(r.round))),
            text(_field(r, "step", None if r.step is None else str(r.step))),
            text(_field(r, "loss", None if r.loss is None else fmt_loss(r.loss))),
            text(_field(r, "time", age)), text(moved),
            text(_attempts(r)),
            text(r.reason or "", limit=80),
        )
    return table


def _attempts(r: Any) -> str:
    """How many times the rank's replica started: its start records, else the heartbeat's attempt + 1."""
    if getattr(r, "attempts", None):
        return str(r.attempts)
    return _field(r, "attempt", None if r.attempt is None else str(r.attempt + 1))


def totals_line(status: RunStatus) -> str:
    """The run totals under the table, e.g. ``state running | round 3/10 | loss 4.2 | ...``."""
    gpu = f" ({status.gpu})" if status.gpu else ""
    devices = f" | {status.devices_per_replica} devices per replica" if status.devices_per_replica > 1 else ""
    parts = [
        f"state {status.state}", f"round {_round_of(status)}",
        *([f"H {status.sync_every[0]} ({status.sync_every[1]})"] if status.sync_every else []),
        f"loss {fmt_loss(status.loss)}",
        f"eval loss {fmt_loss(status.eval_loss)}", f"moved {fmt_bytes(status.bytes_moved)}",
        f"elapsed {fmt_duration(status.elapsed_s)}",
        f"est. spend {fmt_usd(status.est_usd)} on {status.executor or '?'}{gpu}{devices}",
    ]
    return " | ".join(parts)


def status_renderable(status: RunStatus, notes: Sequence[str] = ()) -> Group:
    """Table plus totals, the model location once it exists, and a ``note:`` line for each thing that
    could not be read (a heartbeat field of the wrong type, the ``notes`` given, e.g. bad metrics)."""
    items: list[Any] = [replica_table(status), text(totals_line(status))]
    if (table := rl_table(status)) is not None:  # an RL run: reward, completion length, KL, ... per replica
        items += [table, text(rl_line(status) or "")]
    if status.final_url:
        items.append(text(f"model: {status.final_url}", style="green"))
    items.extend(text(line, style="yellow") for line in note_lines([*status.notes, *notes]))
    return Group(*items)


def note_lines(notes: Iterable[str], limit: int = 200) -> list[str]:
    """``note: <note>`` lines, each made :func:`plain` (notes quote what the store held)."""
    return [f"note: {plain(note, limit)}" for note in notes]


def progress_line(status: RunStatus) -> str:
    """A one-line progress report for non-terminal output (CI logs, pipes)."""
    live = sum(r.state == RUNNING for r in status.replicas)
    starting = sum(r.state == STARTING for r in status.replicas)
    waiting = f" ({starting} starting)" if starting else ""
    return plain(f"[{fmt_duration(status.elapsed_s)}] round {_round_of(status)} | "
                 f"loss {fmt_loss(status.loss)} | {live}/{len(status.replicas)} running{waiting} | "
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
    if (rl := rl_line(status)) is not None:
        lines.insert(3, f"  last round      : {rl}")
    for rank, reason in status.failures:
        lines.append(f"  rank {rank} failed: {reason}")
    return [plain(line) for line in lines] + note_lines(status.notes)


def runs_table(rows: Iterable[Mapping[str, Any]], store_url: str) -> Table:
    """``diloco ls``: one row per run (dicts with run_id, created, executor, replicas, rounds, state)."""
    table = Table(title=text(f"runs under {store_url}"), title_justify="left")
    for col in ("run id", "created", "executor", "replicas", "rounds", "state", "loss"):
        table.add_column(col)
    for row in rows:
        table.add_row(
            text(row.get("run_id", "?"), limit=128), text(row.get("created", "-"), limit=40),
            text(row.get("executor") or "-", limit=40), text(row.get("replicas", "-"), limit=20),
            text(row.get("rounds", "-"), limit=40), _state(row.get("state", "-")),
            text(fmt_loss(row.get("loss"))),
        )
    return table


# ------------------------------------------------------------------------------- RL runs
# ``diloco status`` for an RL run: a compact table of each replica's last round (reward mean ± std and per
# reward function, completion length, KL, entropy, clip fraction, generation share of the round, from the
# heartbeats) and one line of the same numbers averaged over the replicas; nothing for a supervised run.

#: most reward functions shown by name (the rest: the combined reward only)
MAX_FUNCTIONS = 4


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _reward(summary: Mapping[str, float]) -> str:
    mean, std = summary.get("reward_mean"), summary.get("reward_std")
    if mean is None:
        return "-"
    return f"{mean:.3f} ± {std:.3f}" if std is not None else f"{mean:.3f}"


def _functions(summary: Mapping[str, float]) -> str:
    parts = [f"{name} {mean:.3f}" for name, (mean, _std) in list(per_function(summary).items())[:MAX_FUNCTIONS]]
    return ", ".join(parts) or "-"


def rl_table(status: RunStatus) -> Table | None:
    """One row per replica that reports RL numbers (its last round); None for a supervised run."""
    rows = [r for r in status.replicas if r.rl]
    if not rows:
        return None
    table = Table(title=text("RL, last round per replica"), title_justify="left")
    for col, justify in [("rank", "right"), ("round", "right"), ("reward", "right"), ("per function", "left"),
                         ("completion", "right"), ("KL", "right"), ("entropy", "right"), ("clip", "right"),
                         ("generation", "right")]:
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for r in rows:
        rl = r.rl or {}
        table.add_row(
            text(r.rank), text("-" if r.round is None else r.round), text(_reward(rl)),
            text(_functions(rl), limit=80), text(_num(rl.get("completion_length"), ".1f")),
            text(_num(rl.get("rl_kl"), ".3g")), text(_num(rl.get("rl_entropy"), ".3f")),
            text(_pct(rl.get("rl_clip_fraction"))), text(_pct(rl.get("generation_share"))),
        )
    return table


def rl_line(status: RunStatus) -> str | None:
    """``RL: reward 0.412 ± 0.210 | completion 37.5 tokens | KL 0.0012 | entropy 1.234 | clip 2.1% |
    generation 61.0% of the round`` (the replicas' last rounds, averaged); None for a supervised run."""
    rl = status.rl
    if rl is None:
        return None
    parts = [
        f"reward {_reward(rl)}", f"completion {_num(rl.get('completion_length'), '.1f')} tokens",
        f"KL {_num(rl.get('rl_kl'), '.3g')}", f"entropy {_num(rl.get('rl_entropy'), '.3f')}",
        f"clip {_pct(rl.get('rl_clip_fraction'))}", f"generation {_pct(rl.get('generation_share'))} of the round",
    ]
    return plain("RL: " + " | ".join(parts))
