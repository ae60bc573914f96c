"""Send a run's per-round series to experiment trackers: trackio, Weights & Biases, TensorBoard.

::

    tracker = Tracker.open(cfg, run_url=run.url)     # cfg.tracking.backends, e.g. ["trackio", "wandb"]
    tracker.update(run.metrics())                    # logs every round that is complete; call it per poll
    tracker.update(run.metrics(), done=True)         # the run ended: log what is left
    tracker.finish({"final/eval_loss": 2.37, ...})   # summary values, then close every backend

The launcher calls this while it follows a run (``Run.wait``, ``diloco launch`` attached) and
``diloco track`` for a run launched with ``--detach``; replicas never do, so tracker credentials
(``WANDB_API_KEY``) stay on the machine that launched. One tracker run per diloco run, named by the
run id (W&B: also its id, resumed when the same run is tracked again); its config is the run's
``RunConfig`` plus ``run_url``. The step is the exchange round (a fragment sync with Streaming DiLoCo).

A round is logged once every participant of it has written its metrics, or a round two later
exists (a participant died after contributing), or the run has ended; rounds go out in order, so
steps only grow. See :mod:`diloco_serverless.tracking.series` for the keys.

Each backend's SDK is imported only here, inside the methods, so the package works without any of
them. Failure: :func:`check_backends` and :meth:`Tracker.open` raise :class:`TrackingError` (a
``UserInputError``) naming the backend and the fix (a missing package, W&B without a login); a
backend that fails later is dropped with a warning and the others go on: tracking never stops a run.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import logging
import netrc
import os
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from diloco_serverless.config import RunConfig, TrackingConfig
from diloco_serverless.errors import UserInputError, one_line
from diloco_serverless.tracking.series import (
    Metrics,
    by_round,
    global_values,
    number,
    participants_of,
    replica_values,
)

logger = logging.getLogger(__name__)

#: backend name -> (module to import, extra that installs it)
BACKENDS: dict[str, tuple[str, str]] = {
    "trackio": ("trackio", "trackio"),
    "wandb": ("wandb", "wandb"),
    "tensorboard": ("tensorboard", "tensorboard"),
}
#: ``WANDB_MODE`` values that never talk to the W&B server (so need no login).
_WANDB_LOCAL_MODES = frozenset({"offline", "disabled", "dryrun"})


class TrackingError(UserInputError):
    """A tracking backend cannot be used here; the message names it and the fix."""


class Backend(Protocol):
    """One tracker: ``log`` a point at a step, a final ``summary``, ``close``."""

    name: str

    def log(self, values: Mapping[str, float], step: int) -> None: ...

    def summary(self, values: Mapping[str, float | str], step: int) -> None: ...

    def close(self) -> None: ...


def missing_packages(backends: Sequence[str]) -> list[str]:
    """The backends among ``backends`` whose package is not importable here (nothing is imported)."""
    return [b for b in backends if importlib.util.find_spec(BACKENDS[b][0]) is None]


def check_backends(tracking: TrackingConfig) -> None:
    """TrackingError when a configured backend cannot work from here: its package is missing, or W&B
    would need a login (online mode without ``WANDB_API_KEY`` or a ``wandb login`` entry in netrc).
    Cheap: imports nothing; the launcher runs it before it creates the run."""
    for name in missing_packages(tracking.backends):
        raise _missing(name)
    if "wandb" in tracking.backends and not _wandb_can_log():
        raise TrackingError(
            "tracking.backends names 'wandb', but W&B has no login here: run `wandb login` or export WANDB_API_KEY "
            "(or WANDB_MODE=offline to keep the run in ./wandb and `wandb sync` it later)"
        )


def _missing(name: str) -> TrackingError:
    return TrackingError(
        f"tracking.backends names {name!r}, but the {BACKENDS[name][0]} package is not installed here; "
        f"pip install 'diloco-serverless[{BACKENDS[name][1]}]' (or drop {name} from tracking.backends)"
    )


def _wandb_can_log() -> bool:
    if os.environ.get("WANDB_MODE", "").strip().lower() in _WANDB_LOCAL_MODES:
        return True
    if os.environ.get("WANDB_API_KEY", "").strip():
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    path = os.environ.get("NETRC") or str(Path.home() / ".netrc")
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Keep an SDK's banner lines (trackio prints where it logs) out of the launcher's output."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield


# ------------------------------------------------------------------------------------ backends
class TensorBoardBackend:
    """Event files under ``<tensorboard_dir>/<run_id>/`` (``tensorboard --logdir <tensorboard_dir>``),
    written with tensorboard's own writer (no torch, no TensorFlow)."""

    name = "tensorboard"

    def __init__(self, logdir: str | Path, config: Mapping[str, Any]) -> None:
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.logdir = Path(logdir)
        self._writer = EventFileWriter(str(self.logdir), flush_secs=10)
        self._text("config", "```json\n" + json.dumps(config, indent=2, sort_keys=True) + "\n```", 0)

    def _event(self, step: int, summary: Any) -> None:
        from tensorboard.compat.proto import event_pb2

        self._writer.add_event(event_pb2.Event(wall_time=time.time(), step=step, summary=summary))

    def _text(self, tag: str, markdown: str, step: int) -> None:
        from tensorboard.plugins.text.summary_v2 import text_pb

        self._event(step, text_pb(tag, markdown))

    def log(self, values: Mapping[str, float], step: int) -> None:
        from tensorboard.compat.proto import summary_pb2

        self._event(step, summary_pb2.Summary(
            value=[summary_pb2.Summary.Value(tag=k, simple_value=float(v)) for k, v in values.items()]))
        self._writer.flush()

    def summary(self, values: Mapping[str, float | str], step: int) -> None:
        rows = "\n".join(f"| {k} | {v} |" for k, v in values.items())
        self._text("summary", f"| key | value |\n|---|---|\n{rows}", step)
        self.log({k: v for k, v in values.items() if isinstance(v, (int, float))}, step)

    def close(self) -> None:
        self._writer.close()


def wandb_run_id(run_id: str) -> str:
    """The W&B run id of a diloco run: its run id with characters W&B refuses replaced, at most 64."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", run_id)[:64]


class WandbBackend:
    """A W&B run named (and with the id) of the diloco run, resumed if it exists (``resume="allow"``);
    ``WANDB_MODE=offline`` keeps it in ``$WANDB_DIR/wandb/`` for ``wandb sync``."""

    name = "wandb"

    def __init__(self, project: str, run_id: str, config: Mapping[str, Any]) -> None:
        import wandb

        settings = wandb.Settings(console="off", x_disable_stats=True, save_code=False, disable_git=True,
                                  silent=True)
        self.run: Any = wandb.init(project=project, name=run_id, id=wandb_run_id(run_id), config=dict(config),
                              resume="allow", reinit="create_new", job_type="diloco", settings=settings)

    def log(self, values: Mapping[str, float], step: int) -> None:
        self.run.log(dict(values), step=step)

    def summary(self, values: Mapping[str, float | str], step: int) -> None:
        self.run.summary.update(dict(values))

    def close(self) -> None:
        self.run.finish()


class TrackioBackend:
    """A trackio run (the Hub's local-first tracker: a SQLite file under ``$TRACKIO_DIR``, shown by
    ``trackio show``), named by the run id and resumed if it exists."""

    name = "trackio"

    def __init__(self, project: str, run_id: str, config: Mapping[str, Any]) -> None:
        import trackio

        with _quiet():
            self.run: Any = trackio.init(project=project, name=run_id, config=dict(config), resume="allow",
                                    auto_log_gpu=False, auto_log_cpu=False)

    def log(self, values: Mapping[str, float], step: int) -> None:
        self.run.log(dict(values), step=step)

    def summary(self, values: Mapping[str, float | str], step: int) -> None:
        numeric = {k: float(v) for k, v in values.items() if isinstance(v, (int, float))}
        if numeric:
            self.run.log(numeric, step=step)

    def close(self) -> None:
        from trackio import context_vars

        try:
            with _quiet():
                self.run.finish()
        finally:
            if context_vars.current_run.get() is self.run:  # else trackio finishes it again at exit, aloud
                context_vars.current_run.set(None)


def open_backend(name: str, tracking: TrackingConfig, run_id: str, config: Mapping[str, Any]) -> Backend:
    """Build one backend; TrackingError (naming it) when its package is missing or it cannot start."""
    if name not in BACKENDS:
        raise TrackingError(f"unknown tracking backend {name!r}; use trackio, wandb or tensorboard")
    if missing_packages([name]):
        raise _missing(name)
    try:
        if name == "tensorboard":
            return TensorBoardBackend(Path(tracking.tensorboard_dir) / run_id, config)
        if name == "wandb":
            return WandbBackend(tracking.project, run_id, config)
        return TrackioBackend(tracking.project, run_id, config)
    except Exception as e:
        raise TrackingError(f"tracking backend {name} could not start: {one_line(str(e)) or type(e).__name__}") from e


# ------------------------------------------------------------------------------------ the tracker
class Tracker:
    """The run's trackers and which rounds they have; see the module docstring."""

    def __init__(self, backends: Sequence[Backend], *, replicas: int, per_replica: bool = False) -> None:
        self.backends: list[Backend] = list(backends)
        self.replicas = replicas
        self.per_replica = per_replica
        self.next_round = 0  # every round below it is logged (or was skipped as missing)
        self.last_step = 0
        self.totals = {"throughput/tokens_total": 0.0, "exchange/bytes_moved_total": 0.0}
        self.logged = 0

    @classmethod
    def open(cls, cfg: RunConfig, *, run_url: str | None = None) -> Tracker:
        """One backend per ``cfg.tracking.backends``; TrackingError if any cannot start (those
        already started are closed)."""
        check_backends(cfg.tracking)  # before any SDK runs: no login prompt, no half-open trackers
        config = {**cfg.to_json_dict(), **({"run_url": run_url} if run_url else {})}
        backends: list[Backend] = []
        try:
            for name in cfg.tracking.backends:
                backends.append(open_backend(name, cfg.tracking, cfg.run_id, config))
        except BaseException:
            for backend in backends:
                _close_quietly(backend)
            raise
        return cls(backends, replicas=cfg.replicas, per_replica=cfg.tracking.per_replica)

    @property
    def names(self) -> list[str]:
        return [b.name for b in self.backends]

    def settled_rounds(self, rounds: Mapping[int, Mapping[int, Mapping[str, Any]]], done: bool) -> list[int]:
        """Rounds from ``next_round`` on that can be logged now, in order (see the module docstring)."""
        if not rounds:
            return []
        newest = max(rounds)
        out: list[int] = []
        rnd = self.next_round
        while rnd <= newest:
            records = rounds.get(rnd)
            later = newest >= rnd + 2
            if records is None:
                if not (done or later):
                    break
            else:
                expected = participants_of(records) or set(range(self.replicas))
                if not (expected <= set(records) or done or later):
                    break
                out.append(rnd)
            rnd += 1
        return out

    def update(self, metrics: Metrics, *, done: bool = False) -> int:
        """Log every round that is settled and not yet logged; return how many were logged."""
        rounds = by_round(metrics)
        settled = self.settled_rounds(rounds, done)
        for rnd in settled:
            records = rounds[rnd]
            point = global_values(records)
            self.totals["throughput/tokens_total"] += point.get("throughput/tokens", 0.0)
            self.totals["exchange/bytes_moved_total"] += point.get("exchange/bytes_moved", 0.0)
            point.update(self.totals)
            if self.per_replica:
                for rank in sorted(records):
                    point.update(replica_values(rank, records[rank]))
            self._each("log", point, rnd)
            self.last_step = rnd
            self.logged += 1
        if settled:
            self.next_round = settled[-1] + 1
        if done and rounds:
            self.next_round = max(self.next_round, max(rounds) + 1)
        return len(settled)

    def finish(self, summary: Mapping[str, float | str | None] | None = None) -> None:
        """Write the summary (values that are None are left out) and close every backend."""
        if summary:
            clean: dict[str, float | str] = {}
            for k, v in summary.items():
                if isinstance(v, str):
                    clean[k] = v
                elif number(v) is not None:
                    clean[k] = float(v)  # type: ignore[arg-type]  # number() checked it is one
            if clean:
                self._each("summary", clean, self.last_step)
        self.close()

    def close(self) -> None:
        for backend in self.backends:
            _close_quietly(backend)
        self.backends = []

    def _each(self, method: str, values: Mapping[str, Any], step: int) -> None:
        for backend in list(self.backends):
            try:
                getattr(backend, method)(values, step)
            except Exception as e:  # a tracker that fails never stops the run: drop it, keep the others
                logger.warning("tracking: %s failed (%s); no more rounds are sent to it", backend.name,
                               one_line(str(e)) or type(e).__name__)
                self.backends.remove(backend)
                _close_quietly(backend)


def _close_quietly(backend: Backend) -> None:
    try:
        backend.close()
    except Exception as e:
        logger.warning("tracking: closing %s failed: %s", backend.name, one_line(str(e)) or type(e).__name__)
