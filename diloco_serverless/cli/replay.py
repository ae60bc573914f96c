"""``diloco replay``: a student's trace against named teachers, into a preference dataset.

``diloco replay TRACES.jsonl --teachers FILE_OR_PRESET --max-usd 10 -o pairs.parquet`` replays every
state against every teacher (concurrently, under the ceiling, answers cached beside the output so a
re-run pays nothing twice), extracts the pairs where teachers agree against the student, filters them
(:mod:`diloco_serverless.replay.normalize`) and writes a dataset ``data.format = "preference"`` trains
(``--hints`` also writes a ``prompt_response`` dataset with a hint column). A progress bar shows
spend, calls and failures; a table per teacher ends the run. Nothing is sent anywhere unless the user
names the teachers. docs/data.md, "Teacher replay".
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from diloco_serverless.cli.render import plain
from diloco_serverless.errors import StoreError, UserInputError, one_line
from diloco_serverless.replay import (
    PairFilters,
    extract_dpo_pairs,
    extract_hints,
    filter_pairs,
    load_teachers,
    load_trace,
    replay_trace_sync,
)
from diloco_serverless.replay.budget import Budget
from diloco_serverless.replay.errors import ReplayInputError
from diloco_serverless.replay.output import SUFFIXES, write_rows
from diloco_serverless.replay.pairs import REASONS
from diloco_serverless.replay.replay import CallRecord, ReplayResult
from diloco_serverless.replay.report import teacher_summaries

__all__ = ["replay"]

_BAD_INPUT: tuple[type[BaseException], ...] = (UserInputError, StoreError, ValueError, FileNotFoundError, ImportError)


@contextmanager
def _errors() -> Iterator[None]:
    """Bad input: one ``error:`` line, exit 2; anything else: exit 1 (DILOCO_DEBUG=1 shows tracebacks)."""
    if os.environ.get("DILOCO_DEBUG"):
        yield
        return
    err = Console(stderr=True, highlight=False, width=10_000, soft_wrap=True)
    try:
        yield
    except typer.Exit:
        raise
    except _BAD_INPUT as e:
        err.print(Text.assemble(("error:", "bold red"), " ", plain(one_line(str(e)) or type(e).__name__)))
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        err.print(Text.assemble(("error:", "bold red"), " interrupted (answers so far are cached)"))
        raise typer.Exit(130) from None
    except Exception as e:
        err.print(Text.assemble(("error:", "bold red"), " ", plain(f"unexpected {type(e).__name__}: {one_line(str(e))}"
                                                                   " (rerun with DILOCO_DEBUG=1 for the traceback)")))
        raise typer.Exit(1) from None


def _usd(x: float | None) -> str:
    return "-" if x is None else f"${x:.4f}"


def _teacher_table(result: ReplayResult, threshold: int) -> Table:
    table = Table(title="teachers", title_justify="left")
    for col in ("teacher", "model", "calls", "cached", "failed", "not replayed", "mean latency", "tokens in/out",
                "cost", "agreement"):
        table.add_column(col, justify="left" if col in ("teacher", "model") else "right")
    for s in teacher_summaries(result, agreement_threshold=threshold):
        table.add_row(
            plain(s.teacher), plain(s.model), str(s.answered), str(s.cached), str(s.failed), str(s.not_replayed),
            "-" if s.mean_latency_s is None else f"{s.mean_latency_s:.2f}s",
            f"{s.prompt_tokens}/{s.completion_tokens}", _usd(s.cost_usd),
            "-" if s.agreement_rate is None else f"{s.agreement_rate:.0%}")
    return table


def _check_output(path: Path, flag: str) -> None:
    if path.suffix not in SUFFIXES:
        raise ReplayInputError(f"{flag} {path}: must end with .parquet or .jsonl")
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet  # noqa: F401
        except ImportError:
            raise ReplayInputError(f"{flag} {path}: writing parquet needs pyarrow; pip install "
                                   "'diloco-serverless[data]', or write .jsonl") from None


def _filter(rows: list[dict[str, object]], filters: PairFilters) -> tuple[list[dict[str, object]], list[str]]:
    """The normalizer on 🤗 datasets when it is installed, else in plain Python (same result, tested)."""
    try:
        import datasets
    except ImportError:
        kept, dropped = filter_pairs(rows, filters)
        return kept, [reason for _, reason in dropped]
    from diloco_serverless.replay.normalize import filter_pairs_dataset

    datasets.disable_progress_bars()  # this process's output is the table and the summary
    _, dropped = filter_pairs(rows, filters)  # the reasons
    kept_rows = filter_pairs_dataset(datasets.Dataset.from_list(rows), filters).to_list() if rows else []
    return kept_rows, [reason for _, reason in dropped]


def replay(
    traces: Path = typer.Argument(..., help="Trace file: JSONL, one state per line (docs/data.md, 'Teacher replay')."),
    teachers: str = typer.Option(
        ..., "--teachers", "-t", help="Teacher file (TOML or JSON, one teacher table each) or a preset name "
        "(openrouter-frontier). Required: nothing is sent anywhere unless you name the teachers."),
    max_usd: float = typer.Option(..., "--max-usd", help="The most this run may pay (USD); cached answers are free."),
    output: Path = typer.Option(..., "--output", "-o", help="Pairs dataset to write: .parquet or .jsonl."),
    hints: Path | None = typer.Option(
        None, "--hints", help="Also write the consensus as hints: a prompt_response dataset with a hint column."),
    cache: str | None = typer.Option(
        None, "--cache", help="Answer cache: a folder or store URL (default: <output stem>.cache/ beside it)."),
    concurrency: int = typer.Option(8, "--concurrency", "-j", min=1, max=256, help="Calls in flight at most."),
    agreement_threshold: int = typer.Option(2, "--agreement-threshold", min=1,
                                            help="Teachers that must agree for a consensus."),
    no_filter: bool = typer.Option(False, "--no-filter", help="Keep every pair (skip the normalizer's filters)."),
    records: Path | None = typer.Option(
        None, "--records", help="Write one JSON line per call (latency, tokens, cost, status; never the key)."),
) -> None:
    """Replay a trace against teachers; write preference pairs (and hints) where they agree against the student."""
    out = Console(highlight=False) if Console().is_terminal else Console(highlight=False, width=160)
    with _errors():
        if not max_usd >= 0:
            raise ReplayInputError(f"--max-usd must be >= 0, got {max_usd}")
        _check_output(output, "-o")
        if hints is not None:
            _check_output(hints, "--hints")
        states = load_trace(traces)
        teacher_list = load_teachers(teachers)
        cache_url = cache or str(output.with_name(output.stem + ".cache"))
        total = len(states) * len(teacher_list)
        counts = Counter[str]()
        with Progress(TextColumn("replay"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[line]}"),
                      TimeElapsedColumn(), console=out, transient=False, disable=not out.is_terminal) as bar:
            task = bar.add_task("replay", total=total, line="")

            def progress(record: CallRecord, budget: Budget) -> None:
                counts[record.status] += 1
                bar.update(task, advance=1, line=(
                    f"spent ${budget.spent:.4f} / ${budget.max_usd:.2f}  asked {counts['ok']}  "
                    f"cached {counts['cached']}  failed {counts['failed']}  not replayed {counts['not_replayed']}"))

            result = replay_trace_sync(states, teacher_list, max_total_usd=max_usd, concurrency=concurrency,
                                       cache=cache_url, progress=progress)
        out.print(_teacher_table(result, agreement_threshold))
        out.print(Text(f"spent ${result.spent_usd:.4f} of ${result.max_total_usd:.2f} in {result.wall_s:.1f}s; "
                       f"answers cached in {cache_url}"))
        if result.stopped:
            out.print(Text(f"stopped: {result.stopped}", style="yellow"))
        if records is not None:
            records.parent.mkdir(parents=True, exist_ok=True)
            records.write_text("".join(json.dumps(r.to_json()) + "\n" for r in result.records), "utf-8")
        pairs, reasons = extract_dpo_pairs(result, agreement_threshold=agreement_threshold)
        rows = [p.row() for p in pairs]
        kept, dropped = (rows, []) if no_filter else _filter(rows, PairFilters())
        why = Counter(reasons.values())
        out.print(Text(f"states: {len(states)}; pairs: {len(pairs)}; kept after the filters: {len(kept)}"))
        for key, n in why.most_common():
            out.print(Text(f"  no pair, {REASONS[key]}: {n}"))
        for reason, n in Counter(r.split(",")[0] for r in dropped).most_common():
            out.print(Text(f"  filtered out, {reason}: {n}"))
        if not kept:
            raise ReplayInputError(f"no preference pairs to write to {output} (see the reasons above)")
        write_rows(output, kept)
        out.print(Text(f"wrote {len(kept)} pairs to {output} (data.format = \"preference\")"))
        if hints is not None:
            hint_rows = [h.row() for h in extract_hints(result, agreement_threshold=agreement_threshold)]
            if hint_rows:
                write_rows(hints, hint_rows)
                out.print(Text(f"wrote {len(hint_rows)} hints to {hints} (data.format = \"prompt_response\")"))
            else:
                out.print(Text("no hints: no state had a consensus"))
