"""``diloco doctor``: a live check of an executor on a real account, in minutes, with no model or data.

    diloco doctor --executor modal --store s3://bucket/runs --secret diloco-s3
    diloco doctor --executor hf-jobs --store s3://bucket/runs --secret AWS_ACCESS_KEY_ID ...
    diloco doctor --executor local --store ./runs

It launches 2 tiny replicas (:mod:`diloco_serverless.entrypoints.probe`) through the executor, as a
run would, under ``<store>/doctor-<time>-<hex>``: rank 0 ends after a few seconds, rank 1 runs into an
artificial attempt cap (``cap_s``: Modal's function timeout, the HF Job timeout, the local executor's
``attempt_timeout_s``), stops before it with exit code 75 and continues in a next attempt (a chained
Modal call; a fresh HF Job started by the doctor, as the launcher does; the local supervisor's next
attempt). While they run it polls them as ``diloco status`` does, reads rank 1's log, cancels it and
reads the final states; every attempt writes a record signed with the run key to the store, which the
doctor verifies. It prints a table of what held; anything left running is cancelled on the way out.

What it checks is what a run needs from a platform: the credentials, the image or Job starting our
code, the store reachable from the replicas with the credentials given to them, a running call
reported running (not failed), a replica that ends before the others, the chain past a platform's cap,
logs, cancel, and (Modal) that the calls of a detached App keep running after the launcher's App
session has ended (the launch returns after ``app.run(detach=True)`` exits). It is what we ask anyone
who reports a platform problem to run (docs/executors.md, "First run on a real account").
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from diloco_serverless.config import RUN_KEY_ENV
from diloco_serverless.errors import LaunchError, one_line
from diloco_serverless.executors.base import (
    ReplicaHandle,
    ReplicaState,
    ReplicaStatus,
    ServerlessExecutor,
    handle_from_json,
)
from diloco_serverless.executors.registry import build_executor, executor_for_handle
from diloco_serverless.run.integrity import new_run_key, parse_run_key, verify_json
from diloco_serverless.run.layout import probe_key
from diloco_serverless.run.record import join_run_url
from diloco_serverless.store.objectstore import ObjectStore

__all__ = ["CAP_OPTION", "DEFAULT_CAP_S", "Check", "DoctorReport", "run_doctor"]

PROBE = "diloco_serverless.entrypoints.probe"
PROBE_KIND = "doctor-probe"  # entrypoints.probe.PROBE_KIND (the launcher does not import entrypoints)
#: the executor option that sets an attempt's cap, per executor kind
CAP_OPTION = {"modal": "timeout_s", "hf-jobs": "timeout", "local": "attempt_timeout_s"}
#: default artificial cap per kind: long enough for a container to start (an HF Job installs the
#: package's requirements inside its cap), short enough to finish in minutes
DEFAULT_CAP_S = {"modal": 90.0, "hf-jobs": 600.0, "local": 20.0}
#: default executor options of the doctor (``-x`` overrides them): no retries, a CPU container
DEFAULT_OPTIONS: dict[str, dict[str, Any]] = {
    "modal": {"retries": 0, "gpu": None, "poll_interval_s": 2.0},
    "hf-jobs": {"retries": 0, "flavor": "cpu-basic", "poll_interval_s": 5.0},
    "local": {"retries": 0, "poll_interval_s": 0.5},
}
CHAIN_RANK = 1


_FIRST_RUN_DOC = 'docs/executors.md, "First run on a real account"'


@dataclass
class Check:
    """One row of the doctor's table: ``ok`` True (held), False (did not) or None (not reached)."""

    name: str
    ok: bool | None = None
    detail: str = ""


@dataclass
class DoctorReport:
    executor: str
    run_url: str
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def check(self, name: str) -> Check:
        return next(c for c in self.checks if c.name == name)

    def table(self) -> str:
        width = max(len(c.name) for c in self.checks)
        mark = {True: "ok", False: "FAILED", None: "not reached"}
        lines = [f"diloco doctor: {self.executor}, probe run {self.run_url}", "",
                 f"{'check':<{width}}  {'result':<11}  detail", f"{'-' * width}  {'-' * 11}  {'-' * 40}"]
        lines += [f"{c.name:<{width}}  {mark[c.ok]:<11}  {c.detail}" for c in self.checks]
        lines += ["", "all checks held" if self.ok else
                  f"some checks did not hold: see {_FIRST_RUN_DOC}, and send this table with your report"]
        return "\n".join(lines)


CHECKS = (
    "launch 2 ranks",
    "status while running",
    "a rank ending early",
    "chained across the cap",
    "logs",
    "cancel",
    "final state",
    "signed records in the store",
)


def run_doctor(kind: str, store_url: str, *, gpu: str | None = None, executor_options: dict[str, Any] | None = None,
               cap_s: float | None = None, hold_s: float = 5.0, timeout_s: float = 1200.0,
               poll_interval_s: float | None = None, say: Callable[[str], None] = print,
               extra_env: dict[str, str] | None = None, launch_in_child: bool = True) -> DoctorReport:
    """Run the live check (see the module docstring) and return its table; never leaves replicas running.

    ``extra_env`` goes to the replicas besides the run's URL and key (plain settings only: the executors
    drop credential-looking variables, which travel as their secrets). With ``launch_in_child`` (the
    default) the replicas are launched by a child process that exits before the first poll, as a
    launcher on a laptop that is closed: everything after is done from their handles alone."""
    if kind not in CAP_OPTION:
        raise LaunchError(f"diloco doctor: unknown executor {kind!r}; use one of {', '.join(CAP_OPTION)}")
    from diloco_serverless.launcher.preflight import check_store_reachable

    check_store_reachable(store_url, kind)
    cap = float(cap_s if cap_s is not None else DEFAULT_CAP_S[kind])
    options = {**DEFAULT_OPTIONS[kind], CAP_OPTION[kind]: int(cap) if kind != "local" else cap,
               **(executor_options or {})}
    executor = build_executor(kind, gpu, dict(options))
    run_id = f"doctor-{datetime.now(UTC):%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"
    run_url = join_run_url(store_url, run_id)
    store = ObjectStore(run_url)
    key_hex = new_run_key()
    env = {**(extra_env or {}), "DILOCO_RUN_URL": run_url, RUN_KEY_ENV: key_hex}
    report = DoctorReport(executor=kind, run_url=run_url, checks=[Check(n) for n in CHECKS])
    _ship_code_through(store, executor)
    args = ["--run-url", run_url, "--chain-rank", str(CHAIN_RANK), "--hold-s", str(hold_s),
            "--chain-hold-s", str(timeout_s)]
    handles: list[ReplicaHandle] = []
    spec = {"kind": kind, "gpu": gpu, "options": options, "args": args, "env": env, "run_url": run_url}
    try:
        launched = _launch_from_child(spec, say) if launch_in_child else executor.launch_replicas(2, PROBE, args,
                                                                                                   env=env)
        handles.extend(launched)
        relaunch = executor  # starts a next attempt where the platform does not chain (HF Jobs)
        if launch_in_child:  # from here on, only what a later `diloco status` has: the handles
            executor = executor_for_handle(launched[0], run_url=run_url, **options)
        poll_s = poll_interval_s if poll_interval_s is not None else float(getattr(executor, "poll_interval_s", 2.0))
        _drive(executor, relaunch, report, store, parse_run_key(key_hex, source="the doctor's run key"), args, env,
               handles, timeout_s=timeout_s, poll_s=poll_s, say=say, in_child=launch_in_child)
    except Exception as exc:  # the table says where it stopped; the replicas are cancelled below
        pending = next((c for c in report.checks if c.ok is None), None)
        if pending is not None:
            pending.ok, pending.detail = False, f"{type(exc).__name__}: {one_line(str(exc))[:300]}"
    finally:
        if handles:
            try:
                states = executor.poll(handles)
                live = [h for h, s in zip(handles, states) if not s.ended]
                if live:
                    executor.cancel(live)
            except Exception as exc:
                say(f"diloco doctor: could not make sure every probe replica stopped ({one_line(str(exc))}); "
                    f"cancel by hand: {[h.to_json() for h in handles]}")
    return report


def _ship_code_through(store: ObjectStore, executor: ServerlessExecutor) -> None:
    """HF Jobs ship the running code through the run's store, as a launch does (launcher/api.py)."""
    setter = getattr(executor, "set_code_uploader", None)
    if not callable(setter):
        return

    def upload(filename: str, data: bytes) -> str:
        store.put(f"code/{filename}", data)
        return f"{store.url}/code/{filename}"

    setter(upload)


_HANDLES = "diloco-doctor-handles: "


def _launch_from_child(spec: dict[str, Any], say: Callable[[str], None]) -> list[ReplicaHandle]:
    """Launch the 2 probe replicas from a child process (``python -m diloco_serverless.launcher.doctor``,
    the spec on its stdin: the run key never goes on a command line) and wait for it to exit."""
    proc = subprocess.run([sys.executable, "-m", __name__], input=json.dumps(spec), capture_output=True, text=True,
                          check=False)
    for line in proc.stderr.splitlines():
        say(f"  launcher: {line}")
    found = [ln[len(_HANDLES):] for ln in proc.stdout.splitlines() if ln.startswith(_HANDLES)]
    if proc.returncode != 0 or not found:
        tail = one_line("\n".join((proc.stdout + proc.stderr).splitlines()[-5:]))
        raise LaunchError(f"the launching process exited with code {proc.returncode}: {tail[-400:]}")
    handles = [handle_from_json(h) for h in json.loads(found[-1])]
    say(f"the launching process exited (code 0) after launching {len(handles)} replicas")
    return handles


def _child_main() -> int:
    """The launching child of :func:`_launch_from_child`: prints the handles, then exits."""
    spec = json.loads(sys.stdin.read())
    executor = build_executor(spec["kind"], spec["gpu"], dict(spec["options"]))
    _ship_code_through(ObjectStore(spec["run_url"]), executor)
    handles = executor.launch_replicas(2, PROBE, spec["args"], env=spec["env"])
    print(_HANDLES + json.dumps([h.to_json() for h in handles]), flush=True)
    return 0


def _drive(executor: ServerlessExecutor, relaunch: ServerlessExecutor, report: DoctorReport, store: ObjectStore,
           key: bytes, args: list[str], env: dict[str, str], handles: list[ReplicaHandle], *, timeout_s: float,
           poll_s: float,
           say: Callable[[str], None], in_child: bool) -> None:
    deadline = time.monotonic() + timeout_s
    launched = list(handles)
    mode = launched[0].data.get("app_mode")
    ids = ", ".join(str(next((h.data[k] for k in ("function_call_id", "job_id", "supervisor_pid", "pid")
                              if h.data.get(k)), f"rank {h.rank}")) for h in launched)
    launch = report.check("launch 2 ranks")
    launch.ok, launch.detail = True, f"{ids}" + (f" ({mode} App {launched[0].data.get('app_name')})" if mode else "")
    if in_child:
        launch.detail += "; launched by a process that has exited"
    say(f"launched 2 probe replicas: {launch.detail}")

    seen_running = early_done = False
    chained_attempt = 0
    history: list[str] = []
    while time.monotonic() < deadline:
        states = executor.poll(handles)
        line = "  ".join(f"rank {s.rank} {s.status.value}" + (f" (attempt {s.attempt})" if s.attempt else "")
                         for s in states)
        if not history or history[-1] != line:
            history.append(line)
            say(f"status: {line}")
        r0, r1 = states
        bad = [s for s in states if s.status in (ReplicaStatus.FAILED, ReplicaStatus.CANCELLED)]
        if bad:
            raise LaunchError("; ".join(f"rank {s.rank} {s.status.value}: {s.reason}" for s in bad))
        if r1.status is ReplicaStatus.RUNNING and not seen_running:
            seen_running = True
            _held(report, "status while running", f"rank {r1.rank} reported running while it ran ({line})"
                  + (", after the launcher exited" if in_child else ""))
        if r0.status is ReplicaStatus.SUCCEEDED and not early_done:
            if r1.ended:
                raise LaunchError(f"rank 0 ended, but rank 1 had ended too ({r1.status.value}: {r1.reason})")
            early_done = True
            _held(report, "a rank ending early", f"rank 0 succeeded while rank 1 was {r1.status.value}")
        if r1.status is ReplicaStatus.CONTINUE:  # the executor does not chain (HF Jobs): start the next attempt
            chained_attempt = r1.attempt + 1
            (fresh,) = relaunch.launch_replicas(2, PROBE, args, env={**env, "DILOCO_ATTEMPT": str(chained_attempt)},
                                                ranks=[CHAIN_RANK])
            handles[CHAIN_RANK] = fresh
            say(f"rank {CHAIN_RANK} stopped before its cap; started attempt {chained_attempt} (as the launcher does)")
            continue
        attempt = max(r1.attempt, chained_attempt)
        if attempt >= 1 and _record(store, key, CHAIN_RANK, attempt) is not None and early_done and seen_running:
            _held(report, "chained across the cap",
                  f"rank {CHAIN_RANK} stopped before its cap and attempt {attempt} runs"
                  + (f" (call {r1.detail.get('function_call_id')})" if r1.detail.get("function_call_id") else ""))
            break
        time.sleep(poll_s)
    else:
        raise LaunchError(f"timed out after {timeout_s:.0f} s; last status: {history[-1] if history else 'none'}")

    text = ""
    for _ in range(30):  # platforms deliver logs with some delay
        text = executor.logs(handles[CHAIN_RANK], tail=50)
        if f"probe rank={CHAIN_RANK} attempt=" in text:
            break
        time.sleep(poll_s)
    found = [ln for ln in text.splitlines() if f"probe rank={CHAIN_RANK}" in ln]
    if not found:
        raise LaunchError(f"rank {CHAIN_RANK}'s log has no probe line; it reads: {one_line(text)[-200:]!r}")
    _held(report, "logs", f"{len(text.splitlines())} lines, last: {found[-1][:80]}")

    executor.cancel([handles[CHAIN_RANK]])
    cancelled: ReplicaState | None = None
    while time.monotonic() < deadline:
        cancelled = executor.poll([handles[CHAIN_RANK]])[0]
        if cancelled.ended:
            break
        time.sleep(poll_s)
    if cancelled is None or cancelled.status is not ReplicaStatus.CANCELLED:
        raise LaunchError(f"rank {CHAIN_RANK} after cancel: {cancelled.status.value if cancelled else 'no state'}"
                          f" ({cancelled.reason if cancelled else ''})")
    _held(report, "cancel", f"rank {CHAIN_RANK} cancelled ({cancelled.reason or 'no reason given'})")

    final = executor.poll(handles)
    want = [ReplicaStatus.SUCCEEDED, ReplicaStatus.CANCELLED]
    got = [s.status for s in final]
    if got != want:
        raise LaunchError(f"final states {[g.value for g in got]}, expected {[w.value for w in want]}")
    _held(report, "final state", "rank 0 succeeded, rank 1 cancelled")

    wanted = [(0, 0), (CHAIN_RANK, 0), (CHAIN_RANK, max(final[CHAIN_RANK].attempt, chained_attempt))]
    missing = [f"rank {r} attempt {a}" for r, a in wanted if _record(store, key, r, a) is None]
    if missing:
        raise LaunchError(f"no valid signed record of {', '.join(missing)} in {store.url}")
    _held(report, "signed records in the store", f"{len(wanted)} records verified under {store.url}/doctor/")


def _held(report: DoctorReport, name: str, detail: str) -> None:
    check = report.check(name)
    check.ok, check.detail = True, detail


def _record(store: ObjectStore, key: bytes, rank: int, attempt: int) -> dict[str, Any] | None:
    """The probe's signed record of ``rank``'s ``attempt``, or None (absent or not signed with the key)."""
    try:
        doc = store.get_json(probe_key(rank, attempt))
    except Exception:
        return None
    return doc if verify_json(key, PROBE_KIND, doc, place=probe_key(rank, attempt)) else None


if __name__ == "__main__":
    sys.exit(_child_main())
