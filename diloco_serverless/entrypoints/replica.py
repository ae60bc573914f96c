"""One DiLoCo replica: what every executor launches.

    REPLICA_RANK=0 DILOCO_RUN_URL=s3://bucket/runs/run-x python -m diloco_serverless.entrypoints.replica
    python -m diloco_serverless.entrypoints.replica --run-url ./runs/run-x --rank 1

Environment: ``REPLICA_RANK`` (required unless ``--rank``), ``DILOCO_RUN_URL`` (unless ``--run-url``),
``DILOCO_ATTEMPT`` (restart counter, recorded in heartbeats), ``DILOCO_DEVICE`` (default: cuda if
available), storage credentials/endpoints the standard way (``AWS_*``, ``DILOCO_STORAGE_OPTIONS``...).
``DILOCO_ATTEMPT_DEADLINE`` (Unix time) / ``DILOCO_ATTEMPT_TIMEOUT_S`` (seconds from this process's
start): when the platform kills this attempt (the earlier of the two when both are set); the replica
stops before it at an outer-round boundary with its state saved (:mod:`diloco_serverless.trainer.deadline`).
``DILOCO_CODE_VERSION`` (set by executors that ship the launcher's code as a wheel, e.g. HF Jobs):
the replica refuses to start unless the installed package it imports has that version.
Everything else comes from the run's ``run.json``.

A run with ``parallel.devices = G > 1`` makes this process start G local processes of itself, one
per device, and watch them as one replica (:mod:`diloco_serverless.entrypoints.local_group`); each
of those runs with ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` set and trains with the others.

Exit codes: 0 success (or the run had already finished); 2 a problem found before training (bad
run.json, rank outside the run, empty data shard, model/checkpoint mismatch, unreachable store),
printed as one line ``error: ...``; 1 a failure during training (traceback in the log, one-line
summary last); 75 (``CONTINUE_EXIT_CODE``) stopped before the attempt's deadline with its state saved:
start a fresh attempt of the rank, which continues exactly (not a failure, not a retry); 130 interrupted.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time
from pathlib import Path

from diloco_serverless.config import STORE_TIMEOUT_S
from diloco_serverless.entrypoints.local_group import LOCAL_WORLD_SIZE_ENV, cuda_device_count, run_local_group
from diloco_serverless.errors import (
    CheckpointError,
    RunError,
    StoreError,
    UserInputError,
)
from diloco_serverless.executors import _package
from diloco_serverless.executors._proc import proc_start_time
from diloco_serverless.executors.base import (
    ATTEMPT_DEADLINE_ENV,
    ATTEMPT_TIMEOUT_ENV,
    CODE_VERSION_ENV,
    CONTINUE_EXIT_CODE,
)
from diloco_serverless.run.integrity import run_key_from_env
from diloco_serverless.run.record import load_run

__all__ = ["main"]

logger = logging.getLogger("diloco_serverless.replica")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m diloco_serverless.entrypoints.replica",
                                     description="Run one DiLoCo replica of a run stored in an object store.")
    parser.add_argument("--run-url", default=os.environ.get("DILOCO_RUN_URL"),
                        help="<store_url>/<run_id> (default: $DILOCO_RUN_URL)")
    parser.add_argument("--rank", type=int, default=None, help="replica rank (default: $REPLICA_RANK)")
    parser.add_argument("--device", default=os.environ.get("DILOCO_DEVICE"), help="torch device (default: auto)")
    parser.add_argument("--log-level", default=os.environ.get("DILOCO_LOG_LEVEL", "INFO"))
    parser.add_argument("--dump-params", default=os.environ.get("DILOCO_DUMP_PARAMS"), metavar="DIR",
                        help="debugging: write this replica's final global parameters to DIR/rank-<r>.safetensors")
    return parser.parse_args(argv)


def _rank(args: argparse.Namespace) -> int:
    if args.rank is not None:
        return int(args.rank)
    raw = os.environ.get("REPLICA_RANK")
    if raw is None or not raw.strip().lstrip("-").isdigit():
        raise ValueError(f"REPLICA_RANK must be set to this replica's integer rank (got {raw!r}), or pass --rank")
    return int(raw)


def _attempt() -> int:
    raw = os.environ.get("DILOCO_ATTEMPT", "0")
    if not raw.strip().isdigit():
        raise ValueError(f"DILOCO_ATTEMPT must be a non-negative integer, got {raw!r}")
    return int(raw)


def _process_start() -> float:
    """Unix time this process started (``/proc``), else now."""
    ticks = proc_start_time(os.getpid())
    try:
        boot = next(float(ln.split()[1]) for ln in Path("/proc/stat").read_text().splitlines()
                    if ln.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK") if ticks is not None else time.time()
    except (OSError, StopIteration, ValueError, IndexError):
        return time.time()


def _positive_seconds(name: str, raw: str, what: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be {what} (a number above 0), got {raw!r}; fix or unset it")
    return value


def _deadline(started_at: float) -> float | None:
    """This attempt's deadline (Unix time) from ``DILOCO_ATTEMPT_DEADLINE`` / ``DILOCO_ATTEMPT_TIMEOUT_S``
    (the earlier one), or None when neither is set; ValueError (exit code 2) naming a bad value."""
    found: list[float] = []
    raw = os.environ.get(ATTEMPT_DEADLINE_ENV, "").strip()
    if raw:
        found.append(_positive_seconds(ATTEMPT_DEADLINE_ENV, raw, "the attempt's deadline as a Unix time in seconds"))
    raw = os.environ.get(ATTEMPT_TIMEOUT_ENV, "").strip()
    if raw:
        found.append(started_at + _positive_seconds(ATTEMPT_TIMEOUT_ENV, raw, "the attempt's length in seconds"))
    return min(found) if found else None


#: Exception types that mean "fix the input", reported as one line with exit code 2: bad config,
#: data or model name (UserInputError), a missing or invalid run, an unreachable store, a checkpoint
#: that does not fit the model.
_SETUP_ERRORS: tuple[type[BaseException], ...] = (UserInputError, RunError, StoreError, CheckpointError, ValueError)


def _check_shipped_code() -> None:
    """Refuse to run other code than the launcher shipped: ``$DILOCO_CODE_VERSION`` (the wheel's
    ``<version>+src.<content hash>``) must be the version of the installed package beside the
    imported ``diloco_serverless`` (ValueError, exit code 2, otherwise). Nothing to check when unset."""
    want = os.environ.get(CODE_VERSION_ENV, "").strip()
    if not want:
        return
    dist = _package.installed_distribution(_package.PACKAGE_DIR)
    got = dist.version if dist is not None else None
    if got != want:
        raise ValueError(
            f"this replica imports {_package.DIST_NAME} {got or '(no installed metadata)'} from "
            f"{_package.PACKAGE_DIR}, but the launcher shipped {want} (${CODE_VERSION_ENV}); the image's own copy "
            "of the package shadows the shipped one: use an image without it, or launch with install=None to run "
            "the image's copy")


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())


def _dump(trainer: object, folder: str, rank: int) -> None:
    from safetensors.torch import save_file

    Path(folder).mkdir(parents=True, exist_ok=True)
    params = trainer.rep.global_named_parameters()  # type: ignore[attr-defined]
    local = trainer.local  # type: ignore[attr-defined]
    name = f"rank-{rank}.safetensors" if local is None else f"rank-{rank}.local-{local.rank}.safetensors"
    save_file({k: v.contiguous() for k, v in params.items()}, str(Path(folder) / name))


def _devices_per_replica(run_url: str) -> int:
    """``parallel.devices`` of the run (1 inside a local process: it is one device of its replica)."""
    if os.environ.get(LOCAL_WORLD_SIZE_ENV):
        return 1
    _, record = load_run(run_url, None, key=run_key_from_env(), timeout_s=STORE_TIMEOUT_S)
    return record.config.parallel.devices


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s rank=%(rank)s %(name)s: %(message)s")
    rank_text = os.environ.get("REPLICA_RANK", "?") if args.rank is None else str(args.rank)
    old_factory = logging.getLogRecordFactory()

    def factory(*a: object, **kw: object) -> logging.LogRecord:
        record = old_factory(*a, **kw)
        record.rank = rank_text
        return record

    logging.setLogRecordFactory(factory)
    try:
        return _main(args, rank_text, list(sys.argv[1:] if argv is None else argv))
    finally:
        logging.setLogRecordFactory(old_factory)


def _main(args: argparse.Namespace, rank_text: str, argv: list[str]) -> int:
    try:
        if not args.run_url:
            raise ValueError("no run URL: set DILOCO_RUN_URL or pass --run-url <store_url>/<run_id>")
        rank, attempt = _rank(args), _attempt()
        started_at = _process_start()
        deadline = _deadline(started_at)
        _check_shipped_code()
        devices = _devices_per_replica(args.run_url)
        if devices > 1:  # the parent only watches: it does not load torch
            if deadline is not None:  # one deadline for the whole replica, whenever each process starts
                os.environ[ATTEMPT_DEADLINE_ENV] = repr(deadline)
                os.environ.pop(ATTEMPT_TIMEOUT_ENV, None)
            gpus = 0 if args.device is not None else cuda_device_count()
            if 0 < gpus < devices:  # cuda:g for every local process g: each needs its own GPU
                raise ValueError(
                    f"parallel.devices={devices} starts one process per GPU, and this machine has {gpus} "
                    f"CUDA device{'s' if gpus != 1 else ''}; give each replica {devices} GPUs (the executor's "
                    f"GPU count), set parallel.devices={gpus}, or set DILOCO_DEVICE=cpu to run them on the CPU"
                )
            return run_local_group(argv, devices, cuda=gpus > 0)
        import torch

        from diloco_serverless.trainer.deadline import AttemptDeadline
        from diloco_serverless.trainer.local_group import LocalGroup
        from diloco_serverless.trainer.loop import ReplicaTrainer

        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        local = LocalGroup.from_env(device)
        limit = None if deadline is None else AttemptDeadline(deadline=deadline, started_at=started_at)
        trainer = ReplicaTrainer.from_run(args.run_url, rank, attempt=attempt, device=str(device), local=local,
                                          deadline=limit)
    except KeyboardInterrupt:
        return 130
    except _SETUP_ERRORS as exc:
        print(f"error: replica rank {rank_text} of {args.run_url}: {_one_line(exc)}", file=sys.stderr)
        return 2
    try:
        result = trainer.run()
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        logger.exception("training failed")
        print(f"error: replica rank {rank} of {args.run_url} failed: {_one_line(exc)}", file=sys.stderr)
        return 2 if isinstance(exc, _SETUP_ERRORS) else 1
    if result.continuing:
        logger.info("continue: attempt %d saved its state after round %d; exiting with %d so that a fresh attempt "
                    "continues", attempt, result.rounds - 1, CONTINUE_EXIT_CODE)
        return CONTINUE_EXIT_CODE
    if args.dump_params:
        _dump(trainer, args.dump_params, rank)
    logger.info("done: %d rounds (%d trained, %d replayed), final written by this rank: %s, eval loss %s",
                result.rounds, result.trained_rounds, result.replayed_rounds, result.final_written, result.eval_loss)
    return 0


if __name__ == "__main__":
    sys.exit(main())
