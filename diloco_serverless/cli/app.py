"""``diloco``: launch DiLoCo runs on local processes, Modal or Hugging Face Jobs, and watch them.

    diloco launch                                  # 4 local replicas, tiny model, ./runs
    diloco launch --executor modal --gpu H100 --replicas 8 --store s3://bucket/runs
    diloco status RUN_URL --watch | logs RUN_URL --rank 0 --follow | cancel RUN_URL
    diloco resume RUN_URL [--executor modal --gpu H100]   # start again the ranks that are not running
    diloco ls ./runs | plot RUN_URL -o loss.png
    diloco push RUN_URL my-org/my-model            # final/ + model card to the Hub (a run that succeeded)
    diloco track RUN_URL --watch                   # tracking.backends for a run launched with --detach

A thin typer app over :mod:`diloco_serverless.launcher.api`. Bad input (an unknown executor or GPU, a
missing SDK or token, an unwritable store, ``--replicas 0``, an unknown ``--set`` key, a URL with no
run) prints one ``error:`` line with the fix and exits 2 before anything is created; a failed or
cancelled run exits 1 naming the ranks; Ctrl-C during an attached launch cancels the run (130).
Every command that touches the store takes ``--store-timeout SECONDS``, the deadline of each store
operation (default: 30 s; for ``launch`` the config's ``store_timeout_s``), so a store that never
answers ends the command with one ``error:`` line naming the URL (exit 2) instead of hanging.
Set ``DILOCO_DEBUG=1`` to see tracebacks.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.live import Live
from rich.text import Text

from diloco_serverless import __version__
from diloco_serverless.cli.render import (
    note_lines,
    plain,
    plain_lines,
    progress_line,
    runs_table,
    status_renderable,
    summary_lines,
    text,
)
from diloco_serverless.cli.replay import replay as replay_command
from diloco_serverless.errors import (
    ExecutorError,
    LaunchError,
    RunError,
    StoreError,
    UserInputError,
    one_line,
)
from diloco_serverless.launcher.api import Run, RunFailed
from diloco_serverless.launcher.api import launch as api_launch
from diloco_serverless.launcher.api import resume as api_resume
from diloco_serverless.launcher.plot import eval_loss_of, metrics_notes, train_loss_of
from diloco_serverless.launcher.preflight import check_max_usd, parse_options
from diloco_serverless.launcher.pricing import PRICE_TABLES, usd_per_replica_hour
from diloco_serverless.launcher.status import TERMINAL, RunStatus
from diloco_serverless.run.record import RunNotFound, join_run_url, list_runs, timeout_policy
from diloco_serverless.store.objectstore import ObjectStore

app = typer.Typer(
    name="diloco", add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
    help="DiLoCo training across serverless GPU replicas that average through an object store.",
)

EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 1, 2, 130
app.command("replay")(replay_command)  # `diloco replay`: teacher replay into preference pairs (cli/replay.py)

#: Default ``--store-timeout`` of the commands that read a run (status, logs, cancel, ls, plot):
#: short, for a person waiting at a terminal; ``launch`` uses the config's ``store_timeout_s``.
INTERACTIVE_STORE_TIMEOUT_S = 30.0
STORE_TIMEOUT_HELP = (
    "Deadline in seconds of each store operation (retries included); an endpoint that does not answer "
    "in time ends the command with an error."
)
STORE_TIMEOUT_READ_HELP = f"{STORE_TIMEOUT_HELP} The default is short, for interactive use."


def _store_timeout_option(default: float | None, help_text: str) -> Any:
    return typer.Option(default, "--store-timeout", metavar="SECONDS", help=help_text)


def _store_timeout(value: float | None) -> float | None:
    """``--store-timeout`` as given, or LaunchError: a finite number of seconds above zero."""
    if value is not None and (not math.isfinite(value) or value <= 0):
        raise LaunchError(f"--store-timeout must be a positive, finite number of seconds (got {value:g}); "
                          "e.g. --store-timeout 30")
    return value


def _out() -> Console:
    """stdout console; wide when not a terminal so tables stay readable in logs and tests."""
    console = Console(highlight=False)
    return console if console.is_terminal else Console(highlight=False, width=160)


def _err(message: str) -> None:
    """One ``error:`` line; the message may quote what the store held, so it is made plain text."""
    Console(stderr=True, highlight=False, width=10_000, soft_wrap=True).print(
        Text.assemble(("error:", "bold red"), " ", plain(message)))


def _say(out: Console, line: str) -> None:
    """Print one line as text (never markup), made plain: run ids, URLs and reasons may come from the store."""
    out.print(text(line))


#: "The run failed": exit 1. Checked first, so a failed run is never reported as bad input.
_RUN_FAILED: tuple[type[BaseException], ...] = (RunFailed, ExecutorError, TimeoutError)
#: "Fix the input": exit 2. The package's families (docs/architecture.md, "Errors") and the builtin
#: errors a bad path, value or missing extra raise before anything starts.
_BAD_INPUT: tuple[type[BaseException], ...] = (
    UserInputError, RunError, StoreError, ValueError, FileNotFoundError, ImportError,
)


@contextmanager
def _errors() -> Iterator[None]:
    """Turn known exceptions into one ``error:`` line and an exit code (no tracebacks)."""
    if os.environ.get("DILOCO_DEBUG"):
        yield
        return
    try:
        yield
    except typer.Exit:
        raise
    except _RUN_FAILED as e:
        _err(one_line(str(e)))
        raise typer.Exit(EXIT_FAILED) from None
    except _BAD_INPUT as e:
        _err(one_line(str(e)) or type(e).__name__)
        raise typer.Exit(EXIT_BAD_INPUT) from None
    except KeyboardInterrupt:
        _err("interrupted")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except Exception as e:
        _err(f"unexpected {type(e).__name__}: {one_line(str(e))} (rerun with DILOCO_DEBUG=1 for the traceback)")
        raise typer.Exit(EXIT_FAILED) from None


def _version(value: bool) -> None:
    if value:
        typer.echo(f"diloco-serverless {__version__}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the version and exit.")) -> None:
    """DiLoCo across serverless GPU replicas, averaged through an object store."""


class _Progress:
    """Live status table on a terminal; one progress line per change otherwise."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.live: Live | None = None
        self.last_key: Any = None

    def __enter__(self) -> _Progress:
        if self.console.is_terminal:
            self.live = Live(console=self.console, auto_refresh=False, transient=True)
            self.live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.live is not None:
            self.live.__exit__(*exc)

    def update(self, status: Any) -> None:
        if self.live is not None:
            self.live.update(status_renderable(status), refresh=True)
            return
        key = (status.state, status.round, status.loss, [r.state for r in status.replicas])
        if key != self.last_key:
            self.last_key = key
            self.console.print(Text(progress_line(status)))


# ---------------------------------------------------------------------------------------- launch
@app.command()
def launch(
    executor: str = typer.Option("local", "--executor", "-e", help="Where replicas run: local, modal or hf-jobs."),
    replicas: int | None = typer.Option(
        None, "--replicas", "-n",
        help="Number of replicas N (default: config, 4). Local: at most 4 per CPU core and ~512 MiB each "
        "(-x oversubscribe=true to exceed).",
    ),
    gpu: str | None = typer.Option(
        None, "--gpu", "--flavor", help="Modal GPU type (A100, H100, H100:2, ...) or HF Jobs flavor (a10g-large, ...)."
    ),
    store: str | None = typer.Option(
        None, "--store", help="Store URL runs live under: ./runs, s3://bucket/prefix, gs://..."
    ),
    config: Path | None = typer.Option(None, "--config", "-c", help="TOML run config (see docs/config.md)."),
    set_: list[str] = typer.Option(
        [], "--set", "-s", help="Override a config key, e.g. --set inner.lr=3e-4 (repeatable)."
    ),
    detach: bool = typer.Option(False, "--detach", "-d", help="Return after launching; watch with `diloco status`."),
    max_usd: float | None = typer.Option(
        None, "--max-usd", help="Cancel the run before the estimated spend exceeds this."
    ),
    store_from_terraform: Path | None = typer.Option(
        None,
        "--store-from-terraform",
        help="Terraform dir (or saved `terraform output -json` file) whose exchange_url is the store.",
    ),
    run_id: str | None = typer.Option(None, "--run-id", help="Run id (default: run-<date>-<time>-<hex>)."),
    secret: list[str] = typer.Option(
        [], "--secret", help="Modal Secret / HF Jobs secret name with storage credentials (repeatable)."
    ),
    retries: int | None = typer.Option(
        None,
        "--retries",
        min=0,
        help="Restarts per replica after a crash or preemption (executor default: local 2, modal 3, hf-jobs 2).",
    ),
    executor_opt: list[str] = typer.Option(
        [],
        "--executor-opt",
        "-x",
        help="Executor option KEY=VALUE, repeatable (e.g. -x local_source=true, -x namespace=my-org).",
    ),
    poll_interval_s: float = typer.Option(2.0, "--poll-interval", help="Seconds between progress polls.", min=0.1),
    trust_remote_code: bool = typer.Option(
        False,
        "--trust-remote-code",
        help="Confirm model.trust_remote_code: replicas run code from the model repository (docs/security.md).",
    ),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Delete what an earlier run left in the run folder instead of refusing it."
    ),
    store_timeout: float | None = _store_timeout_option(
        None, STORE_TIMEOUT_HELP + " Sets the config's store_timeout_s (default 60), which replicas use too."
    ),
    push_to_hub: str | None = typer.Option(
        None, "--push-to-hub", metavar="ORG/NAME",
        help="When the run succeeds, upload final/ with a model card to this Hub repository (private unless "
        "--set hub.private=false; token from HF_TOKEN or `hf auth login`). Sets hub.repo_id.",
    ),
) -> None:
    """Create a run in the store, start its replicas, and follow it to the end (unless --detach)."""
    out = _out()
    with _errors():
        store_timeout_s = _store_timeout(store_timeout)
        if max_usd is not None:
            check_max_usd(max_usd, "--max-usd")
        if max_usd is not None and detach:
            raise LaunchError("--max-usd needs the launcher attached to enforce it; drop --detach")
        if max_usd is not None and executor in PRICE_TABLES and usd_per_replica_hour(executor, gpu) is None:
            raise LaunchError(
                f"--max-usd needs a price for {executor} GPU {gpu!r}, which the price table lacks; "
                "drop --max-usd or pick a listed GPU"
            )
        options: dict[str, Any] = parse_options(executor_opt)
        if secret:
            options["secrets"] = list(secret)
        if retries is not None:
            options["retries"] = retries
        run = api_launch(
            config,
            executor,
            overrides=set_,
            replicas=replicas,
            store=store,
            run_id=run_id,
            gpu=gpu,
            store_from_terraform=store_from_terraform,
            executor_options=options,
            trust_remote_code=trust_remote_code,
            overwrite=overwrite,
            store_timeout_s=store_timeout_s,
            push_to_hub=push_to_hub,
        )
        _say(out, f"launched {run.config.replicas} {run.executor_kind} replicas of run {run.run_id}")
        _say(out, f"run URL: {run.url}")
        for note in run.notes:
            _say(out, f"note: {note}")
        backends = run.config.tracking.backends
        if detach:
            _say(out, f"follow it with: diloco status {run.url} --watch   (cancel: diloco cancel {run.url})")
            if backends:
                _say(out, f"track it ({', '.join(backends)}) with: diloco track {run.url} --watch")
            if run.config.hub.repo_id:
                _say(out, f"push it when it succeeds: diloco push {run.url} {run.config.hub.repo_id}")
            return
        if backends:
            _say(out, f"tracking: {', '.join(backends)} (project {run.config.tracking.project}, run {run.run_id})")
        _follow_run(out, run, poll_interval_s, max_usd)


def _follow_run(out: Console, run: Run, poll_interval_s: float, max_usd: float | None) -> None:
    """Follow an attached run to its end: progress, summary, failed ranks' logs, the Hub push; Ctrl-C cancels."""
    planned = False

    def on_update(status: RunStatus) -> None:
        nonlocal planned
        plan = None if planned else run.attempt_plan(status)
        if plan is not None:
            planned = True
            progress.console.print(Text(f"plan: {plan}"))
        progress.update(status)

    try:
        with _Progress(out) as progress:
            final = run.wait(poll_interval_s=poll_interval_s, on_update=on_update, max_usd=max_usd)
    except RunFailed as e:
        _print_summary(out, e.status)
        _print_failed_logs(out, run, e.status)
        raise
    except KeyboardInterrupt:
        run.cancel()
        _err(f"interrupted: cancelled run {run.url} (use --detach to leave a run running; "
             f"`diloco resume {run.url}` continues it)")
        raise typer.Exit(EXIT_INTERRUPTED) from None
    _print_summary(out, final)
    if run.config.hub.repo_id:
        _say(out, f"pushing the final model to {run.config.hub.repo_id} ...")
        _say(out, f"pushed: {run.push_to_hub()}")


@app.command()
def resume(
    run_url: str = typer.Argument(..., help="The run: <store_url>/<run_id>, or a run id under ./runs."),
    executor: str | None = typer.Option(
        None, "--executor", "-e", help="Where the ranks run now: local, modal or hf-jobs (default: as launched)."
    ),
    gpu: str | None = typer.Option(None, "--gpu", "--flavor", help="Modal GPU type or HF Jobs flavor."),
    rank: list[int] = typer.Option(
        [], "--rank", "-r", help="Resume only this rank (repeatable), even one that looks alive (stale)."
    ),
    secret: list[str] = typer.Option(
        [], "--secret", help="Modal Secret / HF Jobs secret name with storage credentials (repeatable)."
    ),
    retries: int | None = typer.Option(None, "--retries", min=0, help="Restarts per replica after a crash."),
    executor_opt: list[str] = typer.Option(
        [], "--executor-opt", "-x", help="Executor option KEY=VALUE, repeatable (as for launch)."
    ),
    detach: bool = typer.Option(False, "--detach", "-d", help="Return after starting; watch with `diloco status`."),
    max_usd: float | None = typer.Option(None, "--max-usd", help="Cancel the run before the estimated spend "
                                         "(earlier launches included) exceeds this."),
    poll_interval_s: float = typer.Option(2.0, "--poll-interval", help="Seconds between progress polls.", min=0.1),
    trust_remote_code: bool = typer.Option(
        False, "--trust-remote-code", help="Confirm model.trust_remote_code again (docs/security.md)."
    ),
    store_timeout: float = _store_timeout_option(INTERACTIVE_STORE_TIMEOUT_S, STORE_TIMEOUT_READ_HELP),
) -> None:
    """Start again the ranks of a run that are not running (failed, cancelled, preempted, to continue);
    they heal from the store and go on. Needs the run key this machine kept when it launched the run.

    A run that already succeeded is refused. Executor options (--secret, -x) are not recorded: pass
    them again. Then follows the run like an attached launch (unless --detach)."""
    out = _out()
    with _errors():
        timeout_s = _store_timeout(store_timeout)
        if max_usd is not None:
            check_max_usd(max_usd, "--max-usd")
            if detach:
                raise LaunchError("--max-usd needs the launcher attached to enforce it; drop --detach")
        options: dict[str, Any] = parse_options(executor_opt)
        if secret:
            options["secrets"] = list(secret)
        if retries is not None:
            options["retries"] = retries
        url = run_url
        if "/" not in run_url and "://" not in run_url and Path(DEFAULT_STORE, run_url, "run.json").is_file():
            url = join_run_url(DEFAULT_STORE, run_url)
        run = api_resume(url, executor, gpu=gpu, executor_options=options or None, store_timeout_s=timeout_s,
                         trust_remote_code=trust_remote_code, ranks=rank or None)
        resumed = (run.record.launch or {}).get("resumed") or []
        _say(out, f"resumed rank(s) {', '.join(map(str, resumed))} of run {run.run_id} on {run.executor_kind}")
        _say(out, f"run URL: {run.url}")
        if detach:
            _say(out, f"follow it with: diloco status {run.url} --watch   (cancel: diloco cancel {run.url})")
            return
        _follow_run(out, run, poll_interval_s, max_usd)


def _print_summary(out: Console, status: Any) -> None:
    for line in summary_lines(status):
        out.print(Text(line))


def _print_failed_logs(out: Console, run: Any, status: Any, lines: int = 8) -> None:
    for rank, _ in status.failures:
        try:
            tail = run.logs(rank, tail=lines)
        except Exception:
            continue
        out.print(Text(f"--- last {lines} log lines of rank {rank} ---"))
        out.print(Text("\n".join(plain(line) for line in tail.rstrip("\n").splitlines())))


# ---------------------------------------------------------------------------------------- reading
RUN_HELP = (
    "<store_url>/<run_id> as printed by `diloco launch`, or a run id under ./runs; "
    "default: the latest run under ./runs."
)
DEFAULT_STORE = "./runs"


def _attach(run_url: str | None, store_timeout: float | None) -> Any:
    """Open the run: a run URL, a bare run id under ./runs, or (None) the latest run under ./runs.
    ``store_timeout`` (``--store-timeout``) bounds every store operation, the read of run.json included."""
    timeout_s = _store_timeout(store_timeout)
    if run_url is None:
        # invalid runs are skipped quietly here (``diloco ls`` names them); a warning would print their raw text
        runs = list_runs(DEFAULT_STORE, skipped=[], timeout_s=timeout_s) if Path(DEFAULT_STORE).is_dir() else []
        if not runs:
            raise LaunchError(f"no runs under {DEFAULT_STORE}; pass a run URL such as s3://bucket/runs/<run_id>")
        return Run.attach(runs[-1].url, store_timeout_s=timeout_s)
    try:
        return Run.attach(run_url, store_timeout_s=timeout_s)
    except RunNotFound:
        bare = "/" not in run_url and "://" not in run_url
        if bare and Path(DEFAULT_STORE, run_url, "run.json").is_file():
            return Run.attach(join_run_url(DEFAULT_STORE, run_url), store_timeout_s=timeout_s)
        raise


@app.command()
def status(
    run_url: str | None = typer.Argument(None, help=RUN_HELP),
    watch: bool = typer.Option(False, "--watch", "-w", help="Refresh until the run ends (Ctrl-C to stop watching)."),
    interval_s: float = typer.Option(2.0, "--interval", help="Seconds between refreshes with --watch.", min=0.1),
    store_timeout: float = _store_timeout_option(INTERACTIVE_STORE_TIMEOUT_S, STORE_TIMEOUT_READ_HELP),
) -> None:
    """Per-replica table (state, round, step, loss, heartbeat, bytes moved), totals and est. spend."""
    out = _out()
    with _errors():
        run = _attach(run_url, store_timeout)
        if not watch:
            current = run.status()
            out.print(status_renderable(current, notes=metrics_notes(run.metrics())))
            return
        try:
            with _Progress(out) as progress:
                current = run.status()
                while True:
                    progress.update(current)
                    if current.done:
                        break
                    time.sleep(interval_s)
                    current = run.status()
        except KeyboardInterrupt:
            pass
        current = run.status()
        out.print(status_renderable(current, notes=metrics_notes(run.metrics())))


@app.command()
def logs(
    run_url: str | None = typer.Argument(None, help=RUN_HELP),
    rank: int = typer.Option(0, "--rank", "-r", help="Replica rank."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new lines until the replica ends."),
    tail: int | None = typer.Option(None, "--tail", help="Only the last N lines."),
    interval_s: float = typer.Option(1.0, "--interval", help="Seconds between polls with --follow.", min=0.1),
    store_timeout: float = _store_timeout_option(INTERACTIVE_STORE_TIMEOUT_S, STORE_TIMEOUT_READ_HELP),
) -> None:
    """Print one replica's log (from the executor, or <run>/logs/rank-<r>.log)."""
    with _errors():
        run = _attach(run_url, store_timeout)
        text = run.logs(rank, tail=tail)
        sys.stdout.write(plain_lines(text if follow or text.endswith("\n") or not text else text + "\n"))
        sys.stdout.flush()
        if follow:
            _follow(run, rank, text, interval_s)


def _follow(run: Any, rank: int, seen: str, interval_s: float) -> None:
    """Print what is appended to the log until the replica reaches a terminal state."""
    try:
        while True:
            time.sleep(interval_s)
            text = run.logs(rank)
            new = text[len(seen) :] if text.startswith(seen) else text
            if new:
                sys.stdout.write(plain_lines(new))
                sys.stdout.flush()
            seen = text
            if run.status().replicas[rank].state in TERMINAL:
                return
    except KeyboardInterrupt:
        return


@app.command()
def cancel(
    run_url: str | None = typer.Argument(None, help=RUN_HELP),
    store_timeout: float = _store_timeout_option(INTERACTIVE_STORE_TIMEOUT_S, STORE_TIMEOUT_READ_HELP),
) -> None:
    """Cancel every replica of a run through the executor that launched it."""
    with _errors():
        run = _attach(run_url, store_timeout)

        current = run.status()
        if all(r.state in TERMINAL for r in current.replicas):
            _say(_out(), f"run {run.run_id} already {current.state}; nothing to cancel")
            return
        run.cancel()
        _say(_out(), f"cancelled {len(run.handles)} replicas of run {run.run_id}")


@app.command()
def doctor(
    executor: str = typer.Option(..., "--executor", "-e", help="The executor to check: modal, hf-jobs or local."),
    store: str = typer.Option(..., "--store", help="Store URL the probe run lives under (s3://..., gs://..., ./runs)."),
    gpu: str | None = typer.Option(None, "--gpu", "--flavor", help="GPU / flavor (default: a CPU container)."),
    secret: list[str] = typer.Option([], "--secret", help="Modal Secret / HF Jobs secret with storage credentials."),
    executor_opt: list[str] = typer.Option([], "--executor-opt", "-x", help="Executor option KEY=VALUE."),
    cap_s: float | None = typer.Option(None, "--cap-s", help="The artificial attempt cap rank 1 is chained across "
                                       "(default: modal 90, hf-jobs 600, local 20)."),
    timeout_s: float = typer.Option(1200.0, "--timeout-s", help="Give up (and cancel everything) after this long."),
) -> None:
    """Check an executor on your account in minutes: 2 tiny replicas, one ending early, one chained across an
    artificial cap; status, logs, cancel, final state. Prints a table of what held (docs/executors.md)."""
    from diloco_serverless.launcher.doctor import run_doctor

    with _errors():
        options: dict[str, Any] = parse_options(executor_opt)
        if secret:
            options["secrets"] = list(secret)
        out = _out()
        report = run_doctor(executor, store, gpu=gpu, executor_options=options, cap_s=cap_s, timeout_s=timeout_s,
                            say=lambda line: _say(out, line))
        typer.echo(report.table())
        if not report.ok:
            raise typer.Exit(1)


@app.command("ls")
def ls_(
    store_url: str = typer.Argument(DEFAULT_STORE, help="Store URL runs live under."),
    store_timeout: float = _store_timeout_option(INTERACTIVE_STORE_TIMEOUT_S, STORE_TIMEOUT_READ_HELP),
) -> None:
    """List the runs under a store URL: created, executor, replicas, rounds, state, latest loss
    (rank 0's eval loss when its latest round evaluated, else its training loss).

    A folder whose run.json is invalid (a run_id that is not its folder's name, a config that does not
    validate, ...) is left out and named in a ``note:`` line; so is a run whose status cannot be read."""

    out = _out()
    with _errors():
        root = ObjectStore(store_url, retry=timeout_policy(_store_timeout(store_timeout)))
        rows = []
        skipped: list[tuple[str, str]] = []
        notes: list[str] = []
        for record in list_runs(root, skipped=skipped):
            try:
                run = Run(root.child(record.run_id), record)
                st = run.status(with_metrics=False)
                last = run.latest_metrics(0) or {}
            except StoreError:  # the store itself failed: say so, as every command does
                raise
            except Exception as e:  # the run's folder holds something unusable: list the others
                notes.append(f"run {record.run_id}: cannot read its status ({type(e).__name__}: {one_line(str(e))})")
                continue
            rows.append(
                {
                    "run_id": record.run_id,
                    "created": record.created_at,
                    "executor": st.executor,
                    "replicas": record.config.replicas,
                    "rounds": f"{'-' if st.round is None else st.round}/{record.config.rounds}",
                    "state": st.state if record.launch else "created",
                    "loss": eval_loss_of(last) or train_loss_of(last) or st.loss,
                }
            )
        notes[:0] = [f"skipped {folder}: {one_line(why)}" for folder, why in skipped]
        if rows:
            out.print(runs_table(rows, root.url))
        else:
            _say(out, f"no runs under {root.url}")
        for line in note_lines(notes, limit=300):
            out.print(Text(line, style="yellow"))


@app.command()
def plot(
    run_url: str | None = typer.Argument(None, help=RUN_HELP),
    output: Path = typer.Option(Path("loss.png"), "--output", "-o", help="PNG file to write."),
    store_timeout: float = _store_timeout_option(INTERACTIVE_STORE_TIMEOUT_S, STORE_TIMEOUT_READ_HELP),
) -> None:
    """Plot per-replica training loss and eval loss against rounds (PNG, matplotlib Agg)."""
    with _errors():
        run = _attach(run_url, store_timeout)
        path = run.plot(output)
        out = _out()
        _say(out, f"wrote {path}")
        for line in note_lines(metrics_notes(run.metrics())):
            out.print(Text(line, style="yellow"))


@app.command()
def push(
    run_url: str = typer.Argument(..., help="The run: <store_url>/<run_id>, or a run id under ./runs."),
    repo_id: str | None = typer.Argument(
        None, metavar="[ORG/NAME]", help="Hub model repository; default: the run's hub.repo_id (--push-to-hub)."
    ),
    private: bool | None = typer.Option(
        None, "--private/--public",
        help="Visibility of a repository this creates (default: the run's hub.private, private).",
    ),
    store_timeout: float = _store_timeout_option(INTERACTIVE_STORE_TIMEOUT_S, STORE_TIMEOUT_READ_HELP),
) -> None:
    """Upload a finished run's final model (final/) with a model card and loss plot to the Hub.

    Only a run that succeeded is pushed. The token comes from HF_TOKEN or `hf auth login`, never from the store."""
    out = _out()
    with _errors():
        run = _attach(run_url, store_timeout)
        url = run.push_to_hub(repo_id, private=private)
        _say(out, f"pushed run {run.run_id} to {url}")


@app.command()
def track(
    run_url: str | None = typer.Argument(None, help=RUN_HELP),
    watch: bool = typer.Option(False, "--watch", "-w", help="Keep logging new rounds until the run ends."),
    interval_s: float = typer.Option(2.0, "--interval", help="Seconds between polls with --watch.", min=0.1),
    store_timeout: float = _store_timeout_option(INTERACTIVE_STORE_TIMEOUT_S, STORE_TIMEOUT_READ_HELP),
) -> None:
    """Log a run's per-round series to its tracking.backends (trackio, wandb, tensorboard).

    An attached `diloco launch` does this by itself; use it for a run launched with --detach."""
    out = _out()
    with _errors():
        run = _attach(run_url, store_timeout)
        try:
            final = run.track(follow=watch, poll_interval_s=interval_s)
        except KeyboardInterrupt:
            _say(out, "stopped tracking (the run keeps going)")
            return
        backends = ", ".join(run.config.tracking.backends)
        _say(out, f"tracked run {run.run_id} ({final.state}, round {'-' if final.round is None else final.round}"
                  f"/{run.config.rounds}) to {backends}")


def main() -> None:
    """Console-script entry point (``diloco``)."""
    app()


if __name__ == "__main__":
    main()
