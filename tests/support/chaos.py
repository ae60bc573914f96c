"""Chaos harness: a tiny real run over moto behind :class:`~support.fault_proxy.FaultProxy`, with
scheduled SIGKILLs and restarts; shared by ``tests/chaos/`` and ``benchmarks/chaos.py``.

::

    plan = ChaosPlan(seed=3, fault_rate=0.03, kills=[(1, "after_upload@1"), (0, 25.0)])
    result = run_chaos(plan, workdir, moto_endpoint)
    assert result.ok and result.digest == reference.digest

What :func:`run_chaos` does:

1. creates a bucket on moto (directly) and starts a :class:`FaultProxy` in front of moto with the
   plan's random faults (``fault_rate``, ``fault_kinds``) and targeted ``rules``;
2. launches the run with the real :func:`diloco_serverless.launch` through the proxy (run key and
   all) with an executor that only records what it is asked to start: ``run.json`` is written under
   faults like everything else;
3. starts ``replicas`` real replica processes (``python -m diloco_serverless.entrypoints.replica``, or
   :mod:`support.chaos_replica` for ``nan_ranks``) that reach the store only through the proxy
   (``AWS_ENDPOINT_URL`` and ``$DILOCO_STORAGE_OPTIONS``, whose User-Agent tags each request with
   its rank), each with ``--dump-params`` so its final global parameters land in
   ``workdir/dump/rank-<r>.safetensors``;
4. applies the kill schedule with real SIGKILLs and restarts each killed (or crashed) replica like the
   local executor does: same rank, ``DILOCO_ATTEMPT`` + 1, after ``restart_delay_s``;
5. waits for every replica to exit 0 (or the deadline), then reads ``final/`` and the dumps.

Kill moments (``kills``: ``(rank, when)``): a number is seconds after the replicas start; a phase is
detected from the rank's own store requests as the proxy sees them (exact, unlike polling keys):

================  ==============================================================================
``before_upload``  at rank r's first contribution PUT of the round: killed before the store acts
``after_upload``   once the store has stored rank r's ready marker (all its uploads done; in a direct
                   round without a quorum, its create-only vote), before r hears the answer
``owning_shard``   at rank r's create-only PUT of a reduced shard it owns: killed mid-reduction
``checkpoint``     at rank r's PUT of a checkpoint shard (manifest and data position already written)
``final``          at rank r's first PUT of a model file under ``final/`` (it holds final/LOCK.json);
                   rank :data:`ANY_RANK` means whichever replica writes final/
================  ==============================================================================

A phase may name its round, ``"after_upload@2"`` (default: round 1; ``final`` has none). Each kill
fires once; :attr:`ChaosResult.kills` says which fired, when and in which attempt.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from support import TESTS_DIR
from support.diloco_harness import tiny_run_overrides, write_jsonl
from support.fault_proxy import (
    ALL_KINDS,
    TRANSIENT_KINDS,
    FaultProxy,
    FaultRule,
    RequestInfo,
    Target,
    user_agent_options,
)
from support.moto_s3 import moto_server  # re-exported: the benchmarks start their S3 server from here

__all__ = [
    "ANY_RANK",
    "CREATE_ONLY_KEYS",
    "ChaosPlan",
    "ChaosResult",
    "KillRecord",
    "PHASES",
    "S3_CREDENTIALS",
    "lost_response_rule",
    "moto_server",
    "params_digest",
    "run_chaos",
]

ANY_RANK = -1
PHASES = ("before_upload", "after_upload", "owning_shard", "checkpoint", "final")
S3_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                  "AWS_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
RUN_ID = "chaos"

#: Regex (searched in the key, bucket excluded) of each kind of create-only object a chaos run writes (at
#: N <= 16 a flat round votes instead of writing ``quorum.json``).
CREATE_ONLY_KEYS = {
    "run.json": r"/run\.json$",
    "vote": r"/rounds/\d+/votes/rank-\d+$",
    "reduced": r"/rounds/\d+/reduced/\d+$",
    "checkpoint-manifest": r"/checkpoints/\d+/manifest\.json$",
    "final-lock": r"/final/LOCK\.json$",
}


def lost_response_rule(kind: str, *, nth: int = 1) -> FaultRule:
    """A rule that loses the store's answer to the first ``nth`` create-only PUTs of ``kind`` (a key of
    :data:`CREATE_ONLY_KEYS`): the store creates the object, the writer never hears it did."""
    return FaultRule("drop_after", Target(methods=("PUT",), create_only=True, key=CREATE_ONLY_KEYS[kind]), first_n=nth)


@dataclass(frozen=True)
class ChaosPlan:
    """Faults and kills for one run, and the run's shape.

    ``kills``: ``(rank, when)`` with ``when`` seconds after the replicas start or a phase (module
    docstring). ``rules``: targeted faults (:class:`~support.fault_proxy.FaultRule`, copied per run).
    ``nan_ranks``: ranks whose training loss is NaN (:mod:`support.chaos_replica`).
    """

    seed: int = 0
    fault_rate: float = 0.0
    fault_kinds: tuple[str, ...] = TRANSIENT_KINDS
    kills: tuple[tuple[int, str | float], ...] = ()
    rules: tuple[FaultRule, ...] = ()
    replicas: int = 2
    rounds: int = 3
    sync_every: int = 2
    min_replicas: int | None = None
    nan_ranks: tuple[int, ...] = ()
    faults_during_launch: bool = True
    restart_delay_s: float = 0.5
    max_restarts: int = 4  # per rank, kills and crashes together
    timeout_s: float = 420.0
    straggler_timeout_s: float = 20.0
    takeover_timeout_s: float = 5.0
    extra: tuple[tuple[str, object], ...] = ()  # more --set overrides
    #: ``exchange.topology``: "flat" (default here) keeps the sharded protocol whose phases the kill moments
    #: name (``owning_shard``, the reduced shards) even at N=2, where the config's "auto" picks "direct"
    topology: str = "flat"

    def __post_init__(self) -> None:
        for k in self.fault_kinds:
            if k not in ALL_KINDS:
                raise ValueError(f"unknown fault kind {k!r}")
        for rank, when in self.kills:
            if isinstance(when, str):
                phase, _, rnd = when.partition("@")
                if phase not in PHASES or (rnd and not rnd.isdigit()):
                    raise ValueError(f"kill moment {when!r}: use one of {PHASES}, optionally '@<round>'")
            if rank != ANY_RANK and not 0 <= rank < self.replicas:
                raise ValueError(f"kill of rank {rank}: the run has ranks 0..{self.replicas - 1}")

    def shape(self) -> tuple[Any, ...]:
        """What decides the final parameters (runs with equal shapes and no faults are bit-identical)."""
        return (self.replicas, self.rounds, self.sync_every, self.min_replicas, self.nan_ranks, self.extra,
                self.topology)

    def overrides(self, data_path: str) -> list[str]:
        extra: dict[str, object] = {
            "eval_every": 0, "exchange.straggler_timeout_s": self.straggler_timeout_s,
            "exchange.takeover_timeout_s": self.takeover_timeout_s, "exchange.round_timeout_s": 180,
            "exchange.topology": self.topology, **dict(self.extra),
        }
        if self.min_replicas is not None:
            extra["min_replicas"] = self.min_replicas
        return [f"run_id={RUN_ID}", *tiny_run_overrides(data_path, self.replicas, rounds=self.rounds,
                                                        sync_every=self.sync_every, **extra)]


@dataclass
class KillRecord:
    rank: int  # the rank that was killed (resolved for ANY_RANK)
    when: str | float  # as planned
    fired: bool = False
    at_s: float | None = None  # seconds after the replicas started
    attempt: int | None = None
    detail: str = ""  # the request that triggered it
    missed: bool = False  # a timed kill whose replica was no longer running


@dataclass
class ChaosResult:
    plan: ChaosPlan
    outcome: str  # "ok" | "failed" | "timeout" | "incomplete-final" | "replicas-differ" | "launch-failed"
    wall_s: float
    faults: dict[str, int]
    requests: int
    kills: list[KillRecord]
    exits: dict[int, list[int]]  # rank -> exit code of every attempt
    params: dict[int, dict[str, Any]] = field(default_factory=dict)  # rank -> final global parameters
    digests: dict[int, str] = field(default_factory=dict)
    final_files: list[str] = field(default_factory=list)
    final_done: dict[str, Any] | None = None
    participants: dict[int, list[int]] = field(default_factory=dict)  # round -> participants (from metrics)
    abstained: dict[int, list[int]] = field(default_factory=dict)  # round -> ranks that abstained
    error: str = ""
    logs: dict[int, Path] = field(default_factory=dict)
    run_url: str = ""
    crashes: list[tuple[int, int, int]] = field(default_factory=list)  # (rank, attempt, code): not our kills
    refused_connections: int = 0  # connections the proxy refused (over its bound): should stay 0
    #: every injected fault: (time, kind, method, key, rank)
    fault_events: list[tuple[float, str, str, str, int | None]] = field(default_factory=list)

    @property
    def digest(self) -> str | None:
        """The final parameters' digest when every replica holds the same, else None."""
        values = set(self.digests.values())
        return values.pop() if len(values) == 1 and len(self.digests) == self.plan.replicas else None

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"

    @property
    def kills_fired(self) -> int:
        return sum(k.fired for k in self.kills)

    def log_tail(self, chars: int = 3000) -> str:
        out = []
        for r, path in sorted(self.logs.items()):
            text = path.read_text(errors="replace") if path.exists() else "(no log)"
            out.append(f"--- rank {r} ({path}) ---\n{text[-chars:]}")
        return "\n".join(out)

    def describe(self) -> str:
        """Everything needed to debug a failed chaos assertion (outcome, faults, kills, exits, log tails)."""
        kills = [(k.rank, k.when, k.fired, k.at_s, k.detail) for k in self.kills]
        return (f"outcome={self.outcome} error={self.error!r}\nfaults={self.faults} requests={self.requests} "
                f"kills={kills} exits={self.exits}\nparticipants={self.participants} digests={self.digests}\n"
                f"final={self.final_files}\n{self.log_tail()}")

    def summary(self) -> dict[str, Any]:
        """JSON-able summary (no tensors)."""
        return {
            "seed": self.plan.seed, "outcome": self.outcome, "wall_s": round(self.wall_s, 2), "faults": self.faults,
            "faults_total": sum(self.faults.get(k, 0) for k in ALL_KINDS), "requests": self.requests,
            "kills": [dataclasses.asdict(k) for k in self.kills], "kills_fired": self.kills_fired,
            "crashes": self.crashes, "refused_connections": self.refused_connections,
            "exits": {str(k): v for k, v in self.exits.items()}, "digest": self.digest,
            "digests": {str(k): v for k, v in self.digests.items()}, "final_files": self.final_files,
            "participants": {str(k): v for k, v in self.participants.items()},
            "abstained": {str(k): v for k, v in self.abstained.items()}, "error": self.error,
        }


def params_digest(params: dict[str, Any]) -> str:
    """sha256 over names, dtypes, shapes and bytes of a dict of tensors (bit-identity in one string)."""
    import torch

    h = hashlib.sha256()
    for name in sorted(params):
        t = params[name].detach().cpu().contiguous()
        h.update(f"{name}\0{t.dtype}\0{list(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:32]


# ------------------------------------------------------------------------------------------ launching
class _RecordingExecutor:
    """A ServerlessExecutor that starts nothing: :func:`run_chaos` starts the processes itself."""

    kind = "chaos-harness"

    def __init__(self) -> None:
        self.env: dict[str, str] = {}

    def launch_replicas(self, n_replicas: int, entrypoint: str, entrypoint_args: list[str],
                        env: dict[str, str] | None = None) -> list[dict[str, Any]]:
        self.env = dict(env or {})
        return [{"kind": self.kind, "rank": r} for r in range(n_replicas)]

    def poll(self, handles: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{"rank": h["rank"], "state": "unknown"} for h in handles]

    def cancel(self, handles: list[dict[str, Any]]) -> None:
        pass

    def logs(self, handle: dict[str, Any], tail: int | None = None) -> str | None:
        return None


def _s3_options(endpoint: str) -> dict[str, Any]:
    return {"endpoint_url": endpoint, "key": S3_CREDENTIALS["AWS_ACCESS_KEY_ID"],
            "secret": S3_CREDENTIALS["AWS_SECRET_ACCESS_KEY"], "client_kwargs": {"region_name": "us-east-1"}}


def _create_bucket(moto: str) -> str:
    import boto3

    bucket = f"chaos-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=moto, aws_access_key_id="testing", aws_secret_access_key="testing",
                 region_name="us-east-1").create_bucket(Bucket=bucket)
    return bucket


def _package_root() -> str:
    import diloco_serverless

    return str(Path(diloco_serverless.__file__).resolve().parents[1])


# ------------------------------------------------------------------------------------------ the run
class _Run:
    def __init__(self, plan: ChaosPlan, workdir: Path, moto: str, proxy: FaultProxy) -> None:
        self.plan, self.workdir, self.moto, self.proxy = plan, workdir, moto, proxy
        self.lock = threading.RLock()
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.attempts: dict[int, int] = {}
        self.exits: dict[int, list[int]] = {r: [] for r in range(plan.replicas)}
        self.killed: set[int] = set()  # pids we killed
        self.crashes: list[tuple[int, int, int]] = []  # (rank, attempt, exit code) of exits we did not cause
        self.kills = [KillRecord(rank, when) for rank, when in plan.kills]
        self.t0 = 0.0
        self.base_env: dict[str, str] = {}
        self.run_prefix = ""

    # ---------------------------------------------------------------- processes
    def spawn(self, rank: int) -> None:
        attempt = self.attempts.get(rank, -1) + 1
        self.attempts[rank] = attempt
        log = self.workdir / f"rank-{rank}.log"
        env = {**self.base_env, "REPLICA_RANK": str(rank), "DILOCO_ATTEMPT": str(attempt),
               "DILOCO_STORAGE_OPTIONS": json.dumps({"endpoint_url": self.proxy.url, **user_agent_options(rank)})}
        module = "support.chaos_replica" if self.plan.nan_ranks else "diloco_serverless.entrypoints.replica"
        with log.open("ab") as fh:
            fh.write(f"\n===== chaos harness: rank {rank} attempt {attempt} =====\n".encode())
            fh.flush()
            self.procs[rank] = subprocess.Popen([sys.executable, "-m", module], env=env, stdout=fh,
                                                stderr=subprocess.STDOUT, cwd=str(self.workdir))

    def kill(self, rank: int, record: KillRecord, detail: str) -> bool:
        with self.lock:
            proc = self.procs.get(rank)
            if proc is None or proc.poll() is not None or record.fired:
                return False
            record.fired, record.rank, record.detail = True, rank, detail
            record.at_s, record.attempt = round(time.monotonic() - self.t0, 2), self.attempts[rank]
            self.killed.add(proc.pid)
            proc.send_signal(signal.SIGKILL)
            return True

    # ---------------------------------------------------------------- phase detection (proxy hook)
    def _phase_of(self, req: RequestInfo, stage: str) -> tuple[str, int | None] | None:
        if req.method != "PUT" or req.rank is None or not req.key.startswith(self.run_prefix):
            return None
        key = req.key[len(self.run_prefix):]
        m = re.fullmatch(r"rounds/(\d+)/(contrib/\d+|ready|reduced|votes)/?(rank-\d+|\d+)(?:\.[0-9a-f]+)?", key)
        if m:
            rnd, what, who = int(m.group(1)), m.group(2), m.group(3)
            if stage == "before" and what.startswith("contrib") and who == f"rank-{req.rank}":
                return "before_upload", rnd
            # the ready marker, or the create-only contribution that is the vote of a direct round without a
            # quorum (a flat round's contributions are create-only too, and it votes apart from them)
            if (stage == "after" and who == f"rank-{req.rank}"
                    and (what in ("ready", "votes")
                         or (what.startswith("contrib") and req.create_only and self.plan.topology != "flat"))):
                return "after_upload", rnd
            if stage == "before" and what == "reduced" and req.create_only:
                return "owning_shard", rnd
            return None
        m = re.fullmatch(r"checkpoints/(\d+)/shard-\d+\.safetensors", key)
        if m and stage == "before":
            return "checkpoint", int(m.group(1))
        if stage == "before" and key.startswith("final/") and key not in ("final/LOCK.json", "final/DONE.json"):
            return "final", None
        return None

    def hook(self, req: RequestInfo, stage: str) -> str | None:
        found = self._phase_of(req, stage)
        if found is None:
            return None
        phase, rnd = found
        for rec in self.kills:
            if rec.fired or not isinstance(rec.when, str):
                continue
            want, _, want_round = rec.when.partition("@")
            if want != phase or rec.rank not in (req.rank, ANY_RANK):
                continue
            if phase != "final" and rnd != (int(want_round) if want_round else 1):
                continue
            assert req.rank is not None
            if self.kill(req.rank, rec, f"{stage} {req.method} {req.key[len(self.run_prefix):]}"):
                return "drop"
        return None

    def timed_kills(self) -> None:
        now = time.monotonic() - self.t0
        for rec in self.kills:
            if isinstance(rec.when, (int, float)) and not (rec.fired or rec.missed) and now >= rec.when:
                rank = rec.rank if rec.rank != ANY_RANK else 0
                with self.lock:
                    proc = self.procs.get(rank)
                    alive = proc is not None and proc.poll() is None
                if alive:
                    self.kill(rank, rec, f"timer {rec.when}s")
                elif not rec.missed:  # the replica is already done (or between attempts): record why
                    rec.missed, rec.detail = True, "not fired: the replica was not running"

    # ---------------------------------------------------------------- supervision
    def supervise(self) -> str:
        """Restart killed/crashed replicas until all exit 0; returns "ok", "failed" or "timeout"."""
        deadline = self.t0 + self.plan.timeout_s
        restarts = {r: 0 for r in range(self.plan.replicas)}
        pending: dict[int, float] = {}  # rank -> time to restart
        done: set[int] = set()
        while len(done) < self.plan.replicas:
            if time.monotonic() > deadline:
                return "timeout"
            self.timed_kills()
            for rank in range(self.plan.replicas):
                if rank in done:
                    continue
                if rank in pending:
                    if time.monotonic() >= pending[rank]:
                        del pending[rank]
                        with self.lock:
                            self.spawn(rank)
                    continue
                with self.lock:
                    proc = self.procs[rank]
                    code = proc.poll()
                if code is None:
                    continue
                self.exits[rank].append(code)
                if code != 0 and proc.pid not in self.killed:
                    self.crashes.append((rank, self.attempts[rank], code))
                if code == 0:
                    done.add(rank)
                    continue
                if restarts[rank] >= self.plan.max_restarts:
                    return "failed"
                restarts[rank] += 1
                pending[rank] = time.monotonic() + self.plan.restart_delay_s
            time.sleep(0.05)
        return "ok"

    def stop_all(self) -> None:
        with self.lock:
            for proc in self.procs.values():
                if proc.poll() is None:
                    proc.kill()
            for proc in self.procs.values():
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass


def run_chaos(plan: ChaosPlan, workdir: Path, moto: str, *, keep_store: bool = False) -> ChaosResult:
    """Run ``plan`` once (see the module docstring); never raises for a run that goes wrong, the
    outcome says so. ``moto`` is the moto server's endpoint; ``workdir`` receives logs, data and dumps.
    The run's objects are deleted from moto afterwards unless ``keep_store``."""
    from safetensors.torch import load_file

    from diloco_serverless.config import RunConfig
    from diloco_serverless.launcher.api import launch
    from diloco_serverless.store.objectstore import ObjectStore

    workdir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("DILOCO_KEYS_DIR", str(workdir / "keys"))  # launch() keeps the run key there
    data = write_jsonl(workdir / "data.jsonl")
    bucket = _create_bucket(moto)
    dump = workdir / "dump"
    rules = [dataclasses.replace(r, fired=0) for r in plan.rules]
    t_start = time.monotonic()
    with FaultProxy(moto, seed=plan.seed, rate=plan.fault_rate if plan.faults_during_launch else 0.0,
                    kinds=plan.fault_kinds, rules=rules, lifetime_s=plan.timeout_s + 300) as proxy:
        run = _Run(plan, workdir, moto, proxy)
        run.run_prefix = f"{RUN_ID}/"
        proxy.add_hook(run.hook)
        result = ChaosResult(plan, "launch-failed", 0.0, {}, 0, run.kills, run.exits,
                             logs={r: workdir / f"rank-{r}.log" for r in range(plan.replicas)})
        executor = _RecordingExecutor()
        try:
            cfg = RunConfig.load(None, plan.overrides(data))
            handle = launch(cfg, executor=executor, store=f"s3://{bucket}", storage_options=_s3_options(proxy.url))
            result.run_url = handle.url
        except Exception as exc:
            result.error = f"launch: {type(exc).__name__}: {exc}"
            result.wall_s = time.monotonic() - t_start
            result.faults, result.requests, result.fault_events = proxy.snapshot(), proxy.requests, proxy.injected()
            return result
        proxy.set_faults(rate=plan.fault_rate)
        run.base_env = {
            **{k: v for k, v in os.environ.items() if k != "DILOCO_STORAGE_OPTIONS"},
            **S3_CREDENTIALS, **executor.env,
            "AWS_ENDPOINT_URL": proxy.url, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
            "DILOCO_LOG_LEVEL": "INFO", "DILOCO_DUMP_PARAMS": str(dump),
            "PYTHONPATH": os.pathsep.join([_package_root(), str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]),
            "DILOCO_CHAOS_NAN_RANKS": ",".join(str(r) for r in plan.nan_ranks),
        }
        run.t0 = time.monotonic()
        with run.lock:
            for rank in range(plan.replicas):
                run.spawn(rank)
        try:
            outcome = run.supervise()
        finally:
            run.stop_all()
            result.crashes = run.crashes
        result.wall_s = time.monotonic() - t_start
        result.faults, result.requests, result.fault_events = proxy.snapshot(), proxy.requests, proxy.injected()
        result.refused_connections = proxy.refused_connections

    # what the store holds, read from moto directly (no faults)
    store = ObjectStore(result.run_url, _s3_options(moto))
    try:
        if store.exists("final/DONE.json"):
            result.final_done = store.get_json("final/DONE.json")
        result.final_files = sorted(store.list("final/"))
        for key in store.list("metrics/"):
            rec = store.get_json(key)
            rnd = int(key.rsplit("/", 1)[1].split(".")[0])
            if rec.get("committed") and rec.get("participants") is not None:
                result.participants.setdefault(rnd, sorted(rec["participants"]))
            if rec.get("abstained"):
                result.abstained.setdefault(rnd, [])
                rank = int(key.split("/")[1].split("-")[1])
                if rank not in result.abstained[rnd]:
                    result.abstained[rnd].append(rank)
        if not keep_store:
            store.delete("", recursive=True)  # moto keeps objects in memory
    except Exception as exc:  # reading the outcome must not hide it
        result.error += f" reading the store: {type(exc).__name__}: {exc}"
    for rank in range(plan.replicas):
        path = dump / f"rank-{rank}.safetensors"
        if path.exists():
            result.params[rank] = load_file(str(path))
            result.digests[rank] = params_digest(result.params[rank])
    if outcome != "ok":
        result.outcome = outcome
        result.error += f" exits={run.exits}"
    elif not _final_complete(result):
        result.outcome = "incomplete-final"
        result.error += f" final/ holds {result.final_files}"
    elif result.digest is None:
        result.outcome = "replicas-differ"
        result.error += f" digests={result.digests}"
    else:
        result.outcome = "ok"
    result.error = result.error.strip()
    return result


def _final_complete(result: ChaosResult) -> bool:
    """final/DONE.json exists and every file it lists (key -> SHA-256) is in final/ (a model and a config
    among them)."""
    done = result.final_done
    if not isinstance(done, dict) or not isinstance(done.get("files"), dict):
        return False
    files = set(result.final_files)
    listed = set(done["files"])
    return listed <= files and any(f.endswith(".safetensors") for f in listed) and any(
        f.endswith("config.json") for f in listed)


def compare(results: Sequence[ChaosResult], reference: ChaosResult) -> list[bool]:
    """For each result: are its final parameters bit-identical to the reference's (on every replica)?"""
    return [r.digest is not None and r.digest == reference.digest for r in results]
