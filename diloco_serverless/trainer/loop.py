"""One replica's training loop: heal, then rounds of H inner steps of ``compose_loss`` and a DiLoCo sync.

What every executor runs (through ``python -m diloco_serverless.entrypoints.replica``)::

    trainer = ReplicaTrainer.from_run(run_url, rank)   # validates everything before training
    result = trainer.run()

1. **Heal** (:meth:`ReplicaTrainer.heal`): load the newest complete global checkpoint (global
   parameters, outer optimizer state, manager step, this rank's data position), then replay every
   stored reduced round after it through torchft's own sync code (``DiLoCoReplica.catch_up``), so a
   restarted or late replica holds exactly the global state of the others.
2. **Rounds**: inner AdamW steps on ``compose_loss`` (the lr of ``inner.schedule`` at the global
   inner step, gradient accumulation over ``data.micro_batch_size`` micro-batches,
   ``model.precision``, grad clipping); torchft's DiLoCo hooks on the inner optimizer exchange one
   fragment every H/fragments steps through the
   :class:`~diloco_serverless.trainer.manager.ObjectStoreManager` (DiLoCo, arXiv 2311.08105; Streaming
   DiLoCo, arXiv 2501.18512). Between rounds the replica catches up on rounds the others finished
   without it and re-heals from a checkpoint when it fell behind the pruned rounds.
3. After each exchange round: heartbeat (``members/rank-r.json``) and metrics
   (``metrics/rank-r/<round>.json``: loss components, tokens/s, seconds in inner steps vs blocked on
   the exchange, bytes moved); rank 0 evaluates the global model on the held-out split every
   ``eval_every`` outer rounds; every ``checkpoint_every`` outer rounds the participants write a
   global checkpoint in shards and old rounds/checkpoints are pruned.
4. The end: the global model in Hugging Face format under ``<run>/final/`` (one writer, create-only
   lock, ``final/DONE.json`` marker) — see :func:`diloco_serverless.trainer.checkpoint.write_final`.

A multi-device replica (``parallel.devices = G > 1``) is G such trainers, one per local process
(:class:`~diloco_serverless.trainer.local_group.LocalGroup`): each trains its share of every
batch's micro-batches and the gradients are summed over the G processes (data parallel, the same
global batch as G = 1); the exchange and the outer step are split into G slices
(:mod:`~diloco_serverless.trainer.sliced_manager`, :mod:`~diloco_serverless.trainer.sliced_outer`);
with ``parallel.strategy = "fsdp"`` the model is sharded instead (:mod:`~diloco_serverless.trainer.fsdp`:
FSDP2, each process's exchange slice and outer state are its shards, checkpoints and ``final/`` gathered);
local rank 0 writes the heartbeats, metrics, checkpoints and ``final/`` for the replica, and the
decisions read from the store while others write it (the newest checkpoint, whether the run is
finished) are local rank 0's.

The inner step reads no tensor value into Python (on a GPU: no host-device sync), except once per
exchange round: the round's first batch is validated, the loss components and token counts are
accumulated on the device and read for the metrics, and a non-finite loss is recorded on the
device (the fused AdamW skips that update and every later one of the round through its
``found_inf`` input) and read once, right before the step that hands over the pseudo-gradient,
to abstain from the round.

Failure: configuration problems (rank outside the run, empty data shard, a checkpoint whose shapes
differ from the model) raise before the first step with a message naming the problem; exchange
faults follow torchft semantics (the round is retried or adopted late); anything else propagates
and the heartbeat says ``failed``.
"""

from __future__ import annotations

import logging
import math
import os
import time
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from diloco_serverless.config import STORE_TIMEOUT_S, TRUST_REMOTE_CODE_ENV, RunConfig
from diloco_serverless.data.builder import make_reference_model
from diloco_serverless.errors import ConfigError, StoreError, one_line
from diloco_serverless.exchange._io import shard_bounds
from diloco_serverless.exchange.errors import AbstainedError
from diloco_serverless.loss import LossComponents, TAIDScheduler, compose_loss, scored_tokens
from diloco_serverless.run.integrity import RUN_KEY_ENV, run_key_from_env
from diloco_serverless.run.layout import member_key, metrics_key
from diloco_serverless.run.members import (
    HEARTBEAT_CHECKPOINTING,
    HEARTBEAT_CONTINUING,
    HEARTBEAT_DONE,
    HEARTBEAT_EVALUATING,
    HEARTBEAT_FAILED,
    HEARTBEAT_HEALING,
    HEARTBEAT_TRAINING,
    Heartbeat,
    heartbeat_bytes,
    metrics_bytes,
)
from diloco_serverless.run.record import load_run, store_policy, transfer_policy
from diloco_serverless.run.rl_metrics import rl_summary
from diloco_serverless.run.starts import LAUNCH_ID_ENV, write_start
from diloco_serverless.store.objectstore import ObjectStore
from diloco_serverless.trainer import checkpoint as ckpt
from diloco_serverless.trainer.checkpoint import final_exists, write_final
from diloco_serverless.trainer.deadline import AttemptDeadline
from diloco_serverless.trainer.diloco import DiLoCoReplica, build_diloco
from diloco_serverless.trainer.error_feedback import gather_buffers, restore_buffers
from diloco_serverless.trainer.fragment_merge import enable_fragment_merge, load_merge_state, merge_state
from diloco_serverless.trainer.fsdp import (
    FSDPReplica,
    full_state_dict,
    gather_optimizer_state,
    shard_model,
    shard_optimizer_state,
)
from diloco_serverless.trainer.local_group import LocalGroup
from diloco_serverless.trainer.manager import ExchangeRecord, ObjectStoreManager
from diloco_serverless.trainer.model import autocast, build_model, compile_model
from diloco_serverless.trainer.outer_schedule import schedule_outer_lr
from diloco_serverless.trainer.overlap import DelayedObjectStoreManager, apply_last_update, enable_delay, shown_record
from diloco_serverless.trainer.reports import ReportWriter
from diloco_serverless.trainer.round_plan import RoundPlanner
from diloco_serverless.trainer.segment import COMPONENTS as _COMPONENTS
from diloco_serverless.trainer.segment import Segment as _Segment
from diloco_serverless.trainer.segment import add_components as _add
from diloco_serverless.trainer.segment import micro_batches as _micro_batches
from diloco_serverless.trainer.sliced_manager import SlicedManager
from diloco_serverless.trainer.sliced_outer import shard_outer_optimizers
from diloco_serverless.trainer.steps import make_steps, needs_reference_model, rows_per_pass

logger = logging.getLogger(__name__)

__all__ = ["ReplicaTrainer", "TrainResult"]


@dataclass
class TrainResult:
    rank: int
    rounds: int  # exchange rounds this replica's global state includes
    trained_rounds: int  # rounds this process trained (not replayed)
    replayed_rounds: int
    final_written: bool
    eval_loss: float | None = None
    metrics: list[dict[str, Any]] = field(default_factory=list)
    #: the attempt stopped before its deadline with its state saved: a fresh attempt must continue it
    continuing: bool = False


def _set_global_grads(fragment: Any) -> None:
    """``_StreamingDiLoCoFragment._set_grads`` for fp32 global parameters: the averaged
    pseudo-gradient becomes the ``.grad`` of the fp32 globals the outer optimizer steps."""
    for name, tensor in fragment.original_parameters.items():
        tensor.grad = fragment._grads.pop(name).to(device=tensor.device, dtype=torch.float32)


def keep_global_state_fp32(rep: DiLoCoReplica, *, every_fragment: bool = False) -> None:
    """With low-precision (bf16) parameters, keep the global parameters, the outer step and the
    pseudo-gradients in fp32.

    torchft's DiLoCo fragment keeps the global parameters (``original_parameters``) in the
    parameters' dtype and steps the outer optimizer on the model's own parameters, so with bf16
    parameters the global model, the outer momentum and the exchanged pseudo-gradients would all be
    bf16. Here each such fragment gets fp32 copies of its global parameters with an fp32 outer
    optimizer (same hyper-parameters) over them: the pseudo-gradient is ``fp32 global - bf16 local``
    in fp32 (so the exchange sends and averages fp32), the outer step updates the fp32 globals, and
    the model's parameters become the new globals rounded to bf16. Replay and checkpoints go through
    the same fragment code, so healing stays bit-identical. fp32 fragments are left as they are,
    unless ``every_fragment`` (FSDP: the outer step then runs on plain tensors, the global shards,
    rather than on the sharded parameters).
    """
    for i, frag in enumerate(rep.diloco._fragments):
        if not every_fragment and all(t.dtype == torch.float32 for t in frag.original_parameters.values()):
            continue
        globals_ = {name: t.detach().to(torch.float32, copy=True) for name, t in frag.original_parameters.items()}
        outer = torch.optim.SGD(list(globals_.values()), **frag._outer_optimizer.defaults)
        frag.original_parameters = globals_
        # one flat fp32 buffer per fragment, as build_diloco sized it for the parameters' dtype
        fp32_bytes = sum(t.numel() for t in globals_.values()) * 4
        frag.bucket_cap_mb = max(int(frag.bucket_cap_mb), fp32_bytes + 2**20)  # torchft keeps it in bytes
        frag._outer_optimizer = outer
        rep.outer_optimizers[i] = outer
        frag._set_grads = types.MethodType(_set_global_grads, frag)
        # perform_sync calls save_parameters() right after the outer step: the new fp32 globals go
        # into the (bf16) model instead of the model overwriting them
        frag.save_parameters = frag.restore_parameters


class ReplicaTrainer:
    """One replica of a run. Build with :meth:`from_run`; call :meth:`run`."""

    def __init__(self, cfg: RunConfig, run_store: ObjectStore, rank: int, *, attempt: int = 0,
                 storage_options: dict[str, Any] | None = None, device: str | None = None,
                 exchange_options: dict[str, Any] | None = None, run_key: bytes | None = None,
                 local: LocalGroup | None = None, deadline: AttemptDeadline | None = None) -> None:
        if not 0 <= rank < cfg.replicas:
            raise ValueError(
                f"rank {rank} is outside run {cfg.run_id} ({cfg.replicas} replicas: ranks 0..{cfg.replicas - 1}); "
                "set REPLICA_RANK to one of them"
            )
        self.cfg, self.store, self.rank, self.attempt = cfg, run_store, rank, attempt
        self.run_key = run_key  # signs and verifies everything this replica writes and reads
        #: the replica's other local processes (parallel.devices > 1), None when this is its only one
        self.local = local
        self.local_rank = local.rank if local is not None else 0
        #: local rank 0 speaks for the replica: heartbeats, metrics, evaluation, checkpoints, final/
        self.leader = self.local_rank == 0
        #: the leader's heartbeats and metrics, written in the background (started on first use)
        self._report_writer: ReportWriter | None = None
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.fragments = cfg.exchange.fragments
        self.total_rounds = cfg.rounds * self.fragments
        torch.manual_seed(cfg.seed + 1000 * rank)
        model, self.tokenizer = build_model(cfg.model, cfg.seed)
        ckpt.sync_initial_parameters(run_store, model, run_key)  # identical start on every replica, bit for bit
        self.model = model.to(self.device)  # type: ignore[arg-type]  # transformers wraps .to(); its stub takes the model
        ref = make_reference_model(self.model) if needs_reference_model(cfg) else None
        #: FSDP2 over the local processes (parallel.strategy = "fsdp"): each holds 1/G of the parameters
        self.fsdp = local is not None and cfg.parallel.strategy == "fsdp"
        if self.fsdp:
            assert local is not None
            shard_model(self.model, self.device, local)
        compile_model(self.model, cfg.model)  # after the reference copy: a compiled module does not deep-copy
        if ref is not None:
            compile_model(ref, cfg.model)
        #: what differs between channel-1 kinds (language modelling, GRPO / DPPO rollouts): trainer/steps.py
        self.steps = make_steps(cfg, self.tokenizer, self.model, rank=rank, ref_model=ref, device=self.device,
                                storage_options=storage_options)
        self.data = self.steps.data
        self.manager = self._build_manager(storage_options, {"run_key": run_key, **(exchange_options or {})})
        self.inner = self._build_inner_optimizer()
        self.rep: DiLoCoReplica = build_diloco(
            self.manager,
            self.model,
            self.inner,
            sync_every=cfg.inner.sync_every,
            fragments=self.fragments,
            fragment_sync_delay=cfg.exchange.fragment_sync_delay,
            outer_lr=cfg.outer.lr,
            outer_momentum=cfg.outer.momentum,
            nesterov=cfg.outer.nesterov,
        )
        keep_global_state_fp32(self.rep, every_fragment=self.fsdp)
        if cfg.outer.delay:  # one-step-delay rounds: trainer/overlap.py
            enable_delay(self.rep, eager=cfg.outer.eager)
        self.merge = enable_fragment_merge(self.rep, cfg.exchange.fragment_merge)  # trainer/fragment_merge.py
        if cfg.outer.lr_schedule:  # the outer lr by round: trainer/outer_schedule.py
            schedule_outer_lr(self.rep, cfg.outer.lr_at)
        if self.fsdp:  # the exchange slice, the global parameters and the outer momentum are the shards
            assert local is not None
            self.rep = FSDPReplica(self.rep, local)
        elif local is not None:  # each local process keeps the outer momentum of its slice only
            shard_outer_optimizers(self.rep, local)
        self.total_inner_steps = cfg.rounds * cfg.inner.sync_every  # what inner.schedule spans
        self.taid = self._build_taid()
        #: inner.sync_every = "auto": each round's H from the stored plans (trainer/round_plan.py); the number
        #: of rounds is known once the last round's plan is read (until then an upper bound)
        self.planner = (RoundPlanner(run_store, run_key, cfg, rank, self.rep, on_rounds=self._set_rounds)
                        if cfg.inner.auto_sync else None)
        if self.planner is not None:
            self.total_rounds = self.planner.max_rounds
        self.micro_batch = rows_per_pass(cfg)
        # per-round divergence record, on the device (read once per round, see _check_divergence):
        # the first inner step whose loss was not finite (-1: none) and that loss; _skip is the fused
        # AdamW's found_inf, 1 from that step on, so no update is applied until the exchange
        self._diverged_at = torch.full((), -1, dtype=torch.long, device=self.device)
        self._diverged_loss = torch.zeros((), dtype=torch.float32, device=self.device)
        self._skip = torch.zeros((), dtype=torch.float32, device=self.device)
        if self._fused:
            self.inner.found_inf = self._skip  # type: ignore[attr-defined]  # read by torch's fused AdamW
        self.inner_steps = 0
        self.bytes_up = self.bytes_down = 0
        self.replayed = self.trained = 0
        self.abstentions = 0
        self.prune_failures = 0
        #: Re-train (rather than replay) the stored rounds this rank took part in when it starts again
        #: from a state it knows exactly (its own checkpointed state, or the run's start): the run then
        #: ends with the same bits as without the restart. False: replay them (faster, not exact).
        self.exact_resume = True
        self._note: str | None = None  # shown in the heartbeats of the round after an abstention
        self.last_eval: float | None = None
        self.metrics: list[dict[str, Any]] = []
        #: this attempt's platform deadline: stop at an outer-round boundary before it (module docstring)
        self.deadline = deadline
        self._outer_done = False  # the last round ended a committed outer round
        self._outer_start = time.monotonic()
        self._saved_round: int | None = None  # the round whose state this attempt saved last

    @classmethod
    def from_run(
        cls,
        run_url: str,
        rank: int,
        *,
        attempt: int = 0,
        storage_options: dict[str, Any] | None = None,
        device: str | None = None,
        exchange_options: dict[str, Any] | None = None,
        local: LocalGroup | None = None,
        deadline: AttemptDeadline | None = None,
    ) -> ReplicaTrainer:
        """Load ``run.json`` at ``run_url`` and build rank ``rank``'s trainer (no training yet).

        The run key comes from ``$DILOCO_RUN_KEY`` (what the launcher sends every replica): run.json
        and everything read from the store must then carry its signature. Without it the replica
        cannot tell a forged object from a real one and says so in its log.
        ``model.trust_remote_code`` is honoured only when the launcher was given it on its command
        line (``$DILOCO_TRUST_REMOTE_CODE=1``), never from the stored config alone. ``deadline``: when
        this attempt will be killed by its platform (see :mod:`diloco_serverless.trainer.deadline`).
        """
        run_key = run_key_from_env()
        if run_key is None:
            logger.warning("rank %d: %s is not set: run.json and the exchange objects cannot be verified",
                           rank, RUN_KEY_ENV)
        # run.json is read within the default deadline; everything after it within the run's own
        run_store, record = load_run(run_url, storage_options, key=run_key, timeout_s=STORE_TIMEOUT_S)
        run_store = run_store.with_retry(store_policy(record.config)).with_transfer(transfer_policy(record.config))
        if record.config.model.trust_remote_code and os.environ.get(TRUST_REMOTE_CODE_ENV) != "1":
            raise ConfigError(
                f"{run_store.url}/run.json asks for model.trust_remote_code, but the launcher was not given "
                "--trust-remote-code; refusing to run code from the model repository. Relaunch with "
                "--trust-remote-code if you trust it"
            )
        try:  # this start, for status (running vs starting, attempts) and spend (run/starts.py)
            if 0 <= rank < record.config.replicas:
                write_start(run_store, rank, attempt, launch_id=os.environ.get(LAUNCH_ID_ENV) or None, key=run_key)
        except (StoreError, ValueError) as exc:
            logger.warning("rank %d: start record not written: %s", rank, exc)
        return cls(
            record.config,
            run_store,
            rank,
            attempt=attempt,
            storage_options=storage_options,
            device=device,
            exchange_options=exchange_options,
            run_key=run_key,
            local=local,
            deadline=deadline,
        )

    def _build_manager(self, storage_options: dict[str, Any] | None, extra: dict[str, Any]) -> ObjectStoreManager:
        ex = self.cfg.exchange
        opts: dict[str, Any] = {"takeover_timeout_s": ex.takeover_timeout_s, "topology": ex.topology,
                                "feedback_decay": ex.feedback_decay,
                                "transfer": transfer_policy(self.cfg), **extra}
        if ex.poll_interval_s is not None:
            opts.setdefault("poll_interval_s", ex.poll_interval_s)
        store_url, run_id = self.store.url.rsplit("/", 1)
        if self.local is not None:  # the sharded outer step needs only this process's slice of the mean
            opts.update(local=self.local, gather_result=False,
                        presliced=self.cfg.parallel.strategy == "fsdp")  # FSDP: the shards are the slice
            manager_cls: type[ObjectStoreManager] = SlicedManager
        else:
            manager_cls = DelayedObjectStoreManager if self.cfg.outer.delay else ObjectStoreManager
        return manager_cls(
            store_url,
            self.rank,
            self.cfg.replicas,
            run_id=run_id,
            min_replicas=self.cfg.effective_min_replicas,
            fragments=self.fragments,
            codec=ex.wire_codec,
            error_feedback=ex.error_feedback,
            timeout_s=ex.round_timeout_s,
            straggler_timeout_s=ex.straggler_timeout_s,
            storage_options=storage_options,
            **opts,
        )

    def _build_inner_optimizer(self) -> torch.optim.AdamW:
        """AdamW, fused where torch has a fused kernel for the device (CPU, CUDA, ...): one kernel
        for all parameters, and its ``found_inf`` input skips an update without a host read."""
        inner = self.cfg.inner
        kwargs: dict[str, Any] = {"lr": inner.lr, "betas": inner.betas, "weight_decay": inner.weight_decay}
        try:
            opt = torch.optim.AdamW(self.model.parameters(), fused=True, **kwargs)
            self._fused = True
        except RuntimeError:  # no fused kernel for this device or dtype
            opt = torch.optim.AdamW(self.model.parameters(), **kwargs)
            self._fused = False
        return opt

    def _build_taid(self) -> TAIDScheduler | None:
        loss = self.cfg.loss
        if loss.sdpo_wrapper != "taid" or loss.alpha_sdpo == 0:
            return None
        return TAIDScheduler(
            self.total_inner_steps,
            loss.taid_t_start,
            loss.taid_t_end,
            loss.taid_alpha,
            loss.taid_beta,
            loss.taid_disable_adaptive,
        )

    # ------------------------------------------------------------------ healing
    def heal(self) -> int:
        """Load the newest checkpoint newer than our state (or, when it lacks this replica's own state and the
        rounds since the start are all stored, re-train from the start), then replay stored rounds; returns
        rounds gained."""
        before = self.manager.current_step()
        latest = ckpt.find_latest_checkpoint(self.store, self.run_key)
        if self.local is not None:  # checkpoints complete while we look: the replica heals from one
            latest = self.local.leader_int(-1 if latest is None else latest)
            latest = None if latest < 0 else latest
        position: int | None = None
        own: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None
        if latest is not None and latest + 1 > self.manager.current_step():
            own = ckpt.load_replica_state(self.store, latest, self.rank, self.run_key)
            if self._retrain_from_start(latest, own is None):
                latest = None
        if latest is not None and latest + 1 > self.manager.current_step():
            tensors, info = ckpt.load_checkpoint(self.store, latest, self.run_key)
            self.rep.load_state_tensors(tensors, info.meta, source=f"{self.store.url}/checkpoints/{latest:08d}")
            state = ckpt.read_data_state(self.store, latest, self.rank, self.run_key)
            if state is not None:
                self.data.load_state_dict(state)
                position = self.data.position
            if own is not None:
                self._restore_replica_state(*own)
            if own is None and self.exact_resume:
                suffix = (" without this replica's own state (none was saved for this rank): its inner optimizer "
                          "starts fresh, so a replica that trained before its restart does not resume bit-exactly")
            else:
                suffix = " with this replica's own state" if own is not None else ""
            logger.info("rank %d: loaded checkpoint of round %d (step %d)%s", self.rank, latest, info.step, suffix)
        elif latest is None and self.manager.current_step() == 0 and self.exact_resume:
            # No checkpoint yet: this process starts from exactly the state the run started from
            # (stored initial parameters, a fresh optimizer, seeded RNG, data position 0), so rounds
            # this rank took part in are re-trained exactly, not replayed.
            self.manager.retrain_own_rounds = True
        replayed = self.rep.catch_up(self.total_rounds)
        self.replayed += replayed
        gained = self.manager.current_step() - before
        if gained:
            now = self.manager.current_step()
            self.inner_steps = self._steps_before(now)
            implied = self.inner_steps * self.cfg.data.batch_size
            self.data.position = (
                implied if position is None
                else position + (self.inner_steps - self._steps_before(now - replayed)) * self.cfg.data.batch_size
            )
        return gained

    def _retrain_from_start(self, latest: int, lacks_own_state: bool) -> bool:
        """Whether to ignore checkpoint ``latest`` and re-train from the run's start: it lacks this
        replica's own state (the replica was down when it was written, and another rank took its shard
        over), this process starts from the run's initial state, and every round up to ``latest`` is still
        stored (none was pruned yet). Re-training them keeps the resume exact; loading the checkpoint
        would continue with a fresh inner optimizer. One answer for all local processes (the leader's)."""
        applied = latest - self.cfg.outer.delay  # outer.delay: the checkpoint's own round may still be open
        retrain = (lacks_own_state and self.exact_resume and self.manager.current_step() == 0
                   and (applied < 0 or (self._holds_round(0) and self._holds_round(applied))))
        if self.local is not None:
            retrain = bool(self.local.leader_int(int(retrain)))
        if retrain:
            logger.info("rank %d: the checkpoint of round %d lacks this replica's own state (it was down when the "
                        "checkpoint was written); re-training rounds 0-%d from the run's start instead of loading it, "
                        "so the resume stays exact", self.rank, latest, latest)
        return retrain

    def _replica_state(
        self, buffers: dict[str, torch.Tensor] | None = None
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """What this replica alone knows and a restart would otherwise lose: the inner optimizer's
        moments and step counts, its hyper-parameters, the TAID scheduler, the RNG, and the error-feedback
        ``buffers`` (:func:`~diloco_serverless.trainer.error_feedback.gather_buffers`, a collective call with
        several local processes; ``None``: this process's own)."""
        opt = gather_optimizer_state(self.local, self.inner) if self.fsdp else self.inner.state_dict()  # type: ignore[arg-type]
        tensors: dict[str, torch.Tensor] = {"rng/torch": torch.get_rng_state()}
        scalars: dict[str, dict[str, Any]] = {}
        for idx, entry in opt["state"].items():
            for name, value in entry.items():
                if isinstance(value, torch.Tensor):
                    tensors[f"optim/{idx}/{name}"] = value.detach().to("cpu")
                else:
                    scalars.setdefault(str(idx), {})[name] = value
        if torch.cuda.is_available() and self.device.type == "cuda":
            tensors["rng/cuda"] = torch.cuda.get_rng_state(self.device)
        tensors.update(buffers if buffers is not None else gather_buffers(self.manager, None, self.fragments))
        tensors.update(getattr(self.manager, "own_state", dict)())  # outer.delay: the eager start
        tensors.update(merge_state(self.merge))  # exchange.fragment_merge = "eager": the last sync's offset
        at, loss = torch.stack([self._diverged_at.double(), self._diverged_loss.double()]).tolist()
        doc = {
            "param_groups": opt["param_groups"],
            "optim_scalars": scalars,
            "taid": self.taid.state_dict() if self.taid is not None else None,
            "inner_steps": self.inner_steps,
            # a non-finite loss after this round's exchange was handed over: the next round abstains
            "diverged": {"at": int(at), "loss": repr(loss)} if at >= 0 else None,
            "abstain_reason": self.manager.abstain_reason,
        }
        return tensors, doc

    def _restore_replica_state(self, tensors: dict[str, torch.Tensor], doc: dict[str, Any]) -> None:
        """Put back what :meth:`_replica_state` saved (after the global checkpoint was loaded); from then
        on, rounds this rank took part in are re-trained rather than replayed (exact resume)."""
        state: dict[int, dict[str, Any]] = {}
        for name, value in tensors.items():
            if name.startswith("optim/"):
                _, idx, field_name = name.split("/", 2)
                state.setdefault(int(idx), {})[field_name] = value
        for idx, extra in doc.get("optim_scalars", {}).items():
            state.setdefault(int(idx), {}).update(extra)
        # the implementation is this replica's choice, not the checkpoint's (one written before AdamW
        # was fused, or on another device, would otherwise switch it off: found_inf needs fused)
        impl = ("fused", "foreach", "capturable")
        groups = [{**saved, **{k: now.get(k) for k in impl}} for saved, now in
                  zip(doc["param_groups"], self.inner.param_groups)]
        if self.fsdp:  # the checkpoint holds the whole moments: keep this process's rows
            state = shard_optimizer_state(self.local, self.inner, state)  # type: ignore[arg-type]
        self.inner.load_state_dict({"state": state, "param_groups": groups})
        torch.set_rng_state(tensors["rng/torch"])
        if "rng/cuda" in tensors and torch.cuda.is_available() and self.device.type == "cuda":
            torch.cuda.set_rng_state(tensors["rng/cuda"], self.device)
        restore_buffers(self.manager, tensors, self.local)
        if callable(load_own := getattr(self.manager, "load_own_state", None)):
            load_own(tensors)
        load_merge_state(self.merge, tensors)
        if self.taid is not None and doc.get("taid") is not None:
            self.taid.load_state_dict(doc["taid"])
        diverged = doc.get("diverged")
        self._diverged_at.fill_(-1 if diverged is None else int(diverged["at"]))
        self._diverged_loss.fill_(0.0 if diverged is None else float(diverged["loss"]))
        self._skip.fill_(0.0 if diverged is None else 1.0)
        self.manager.abstain_reason = doc.get("abstain_reason")
        self.manager.retrain_own_rounds = True

    def check_checkpoint_compatible(self) -> None:
        """Raise CheckpointMismatch before training if the run's newest checkpoint does not fit the model."""
        latest = ckpt.find_latest_checkpoint(self.store, self.run_key)
        if latest is not None:
            tensors, info = ckpt.load_checkpoint(self.store, latest, self.run_key)
            self.rep.check_compatible(tensors, info.meta, source=f"{self.store.url}/checkpoints/{latest:08d}")

    # ------------------------------------------------------------------ the loop
    def run(self) -> TrainResult:
        """Heal, train until the run's last round, write the final model. See the module docstring."""
        self._heartbeat(HEARTBEAT_HEALING)
        try:
            self.heal()  # raises CheckpointMismatch before any training if the checkpoint does not fit
            done = final_exists(self.store, self.run_key)
            if self.local is not None:
                done = bool(self.local.leader_int(int(done)))
            if done:
                logger.info("rank %d: run %s already finished (final/DONE.json exists)", self.rank, self.cfg.run_id)
                self._close_reports()
                self.manager.shutdown()
                return TrainResult(self.rank, self.manager.current_step(), 0, self.replayed, False, self.last_eval)
            self._outer_start = time.monotonic()
            with self.rep:
                while self.manager.current_step() < self.total_rounds:
                    self._one_round()
                    if self._deadline_near():
                        return self._continue_later()
        except BaseException as exc:
            self._heartbeat(HEARTBEAT_FAILED, message=f"{type(exc).__name__}: {exc}"[:500])
            raise
        return self._finish()

    def _one_round(self) -> None:
        """Catch up if the others are ahead, then inner steps until the next exchange round finished."""
        self._outer_done = False
        replayed = self.rep.catch_up(self.total_rounds) if self._may_be_behind() else 0
        if self.manager.retrain_own_rounds:
            self._leave_retraining()
        if replayed:  # the others finished rounds without us: skip the data they stand for
            self.replayed += replayed
            now = self.manager.current_step()
            skipped = self._steps_before(now) - self._steps_before(now - replayed)
            self.inner_steps += skipped
            self.data.position += skipped * self.cfg.data.batch_size
        if self.planner is not None and not self.planner.plan(self.manager.current_step()):
            return  # the run's inner steps are all done
        if self.manager.current_step() >= self.total_rounds:
            return
        round_, seg = self.manager.current_step(), _Segment()
        self._heartbeat(HEARTBEAT_TRAINING)
        self._note = None
        while True:
            self._inner_step(seg)
            if self.rep.at_boundary:
                break
        record = self.manager.history[-1] if self.manager.history else None
        if record is not None and record.round == round_ and record.abstained is not None:
            self._after_abstention(round_, record.abstained)
        committed = self.manager.current_step() > round_
        if record is not None and record.round == round_ and isinstance(record.failure, AbstainedError):
            # every replica of the round raised the same error: retrying would only repeat it
            raise record.failure
        if committed:
            self.trained += 1
            if self.manager.current_step() >= self.total_rounds:  # outer.delay: the last round's average
                apply_last_update(self.rep)
        else:  # the round failed on this replica: the others may have moved on and pruned
            self.heal()
        self._after_round(round_, seg, shown_record(self.manager, round_, record), committed)

    def _may_be_behind(self) -> bool:
        """Whether the others may have finished the next round without this replica, so that the store
        must be asked before training it (two requests in sequence: the round's quorum, its votes).

        False right after a round this replica took part in live: the others needed its contribution to
        end that round, and they end the next one without it only after their straggler timeout, long
        after this replica has started it (a replica that does fall behind anyway finds the round closed
        when it publishes, ``late``, and catches up before the round after). True at the start, while
        it re-trains rounds it took part in before a restart (those rounds were closed long ago, yet
        look live), and after a failed, late, replayed or abstained round.
        """
        last = self.manager.history[-1] if self.manager.history else None
        behind = self.manager.retrain_own_rounds or not (
            last is not None and last.round == self.manager.current_step() - 1 and not last.replayed
            and not last.late and last.error is None and last.abstained is None
            and (self.rank in last.participants or getattr(self.manager, "in_flight", _never)(last.round)))
        if self.local is not None:  # one decision for the replica: local rank 0's
            behind = bool(self.local.leader_int(int(behind)))
        return behind

    def _leave_retraining(self) -> None:
        """Stop treating stored rounds as possibly this rank's own once the store holds no outcome of the
        round about to be trained: every later round is new to this replica (a process from before the
        restart never got past this one), so the rounds from here on are live."""
        round_ = self.manager.current_step()
        if round_ >= self.total_rounds:
            return
        frontier = not self._holds_round(round_)
        if self.local is not None:
            frontier = bool(self.local.leader_int(int(frontier)))
        if frontier:
            self.manager.retrain_own_rounds = False

    def _holds_round(self, round_: int) -> bool:
        """Whether the store holds the outcome of ``round_`` (of its fragment's shape; no data is read)."""
        return self.manager.holds_round(round_, self.rep.flat_like(round_ % len(self.rep.fragments)))

    def _after_abstention(self, round_: int, reason: str) -> None:
        """This replica did not contribute to ``round_`` (non-finite loss or pseudo-gradient). DiLoCo
        has already set its parameters to the new global ones; the inner optimizer's moments may hold
        NaN/Inf, so they start again. The heartbeat says why until the next round."""
        self.inner.state.clear()
        self.abstentions += 1
        self._note = f"abstained from round {round_}: {reason}"[:500]

    def _inner_step(self, seg: _Segment) -> None:
        """One inner step: the scheduled lr, forward/backward of ``compose_loss`` over the batch's
        micro-batches (gradients summed to the whole batch's), clipping, the inner optimizer (whose
        torchft hooks may prepare or perform an exchange). Reads no tensor value except on the
        round's first step (batch validation) and right before the exchange is prepared."""
        cfg = self.cfg
        lr = cfg.inner.lr_at(self.inner_steps, self.total_inner_steps)
        for group in self.inner.param_groups:
            group["lr"] = lr
        with autocast(cfg.model, self.device):  # the DPO reference forwards of the batch, too
            batch = self.steps.next_batch()
        self.inner.zero_grad(set_to_none=True)
        comps = self._forward_backward(batch, validate=seg.steps == 0)
        self.steps.after_step(comps)
        if cfg.inner.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.inner.grad_clip, foreach=True)
        bad = self._record_divergence(comps.total)
        if seg.steps + 1 == self.rep.inner_steps_per_round - self.rep.diloco._fragment_sync_delay:
            self._check_divergence()  # this step's inner.step() hands the pseudo-gradient over
        if not self._fused and bool(self._skip):  # no found_inf: drop the gradients instead
            self.inner.zero_grad(set_to_none=True)
        self.inner.step()  # torchft's DiLoCo hooks may prepare/perform a fragment sync here
        if self.taid is not None and not bool(bad):
            self.taid.update_t(comps.sdpo_jsd, self.inner_steps)
        self.inner_steps += 1
        seg.add(comps, batch["attention_mask"].sum())

    def _forward_backward(self, batch: Mapping[str, Any], *, validate: bool = False) -> LossComponents:
        """Accumulate into ``.grad`` the gradient of the loss of ``batch``, in micro-batches of
        ``data.micro_batch_size`` rows under the model's precision; returns the batch's loss
        components (the micro-batches' shares summed: the same as one pass over the whole batch)."""
        kwargs = {**self.cfg.loss.compose_kwargs(taid_t=self.taid.t if self.taid else None), **self.steps.loss_kwargs()}
        size = self.micro_batch
        if self.local is not None:  # at least one micro-batch per local process
            size = min(size, -(-int(batch["input_ids"].shape[0]) // self.local.size))
        parts = _micro_batches(batch, size)
        if len(parts) > 1:  # each micro-batch's loss is its share of the whole batch's mean
            kwargs.update(token_count=scored_tokens(batch), pair_count=float(batch["input_ids"].shape[0]))
        every = parts
        if self.local is not None:  # this local process's consecutive share of the micro-batches
            lo, hi = shard_bounds(len(parts), self.local.size)[self.local.rank]
            parts = parts[lo:hi]
        passes: list[dict[str, Any] | None] = list(parts)
        if self.fsdp:  # FSDP's collectives: as many forward/backward passes on every local process
            passes += [None] * (-(-len(every) // self.local.size) - len(parts))  # type: ignore[union-attr]
        comps: LossComponents | None = None
        for i, part in enumerate(passes):
            if self.fsdp:  # reduce-scatter the accumulated gradients once, after the last pass
                self.model.set_requires_gradient_sync(i == len(passes) - 1)
            with autocast(self.cfg.model, self.device):
                out = compose_loss(self.model, part if part is not None else every[-1],
                                   validate=validate and part is not None, **kwargs)
            if part is None:  # a pass with no share of the batch: zero gradient
                (out.total * 0.0).backward()  # type: ignore[no-untyped-call]  # untyped in torch
                continue
            out.total.backward()  # type: ignore[no-untyped-call]  # untyped in torch
            comps = out if comps is None else _add(comps, out)
        if self.local is not None and not self.fsdp:  # DDP: the whole batch's gradient on every local process
            self.local.sum_gradients([p for p in self.model.parameters() if p.requires_grad])
        if self.local is not None:  # the whole batch's loss on every local process
            mine = (torch.stack([getattr(comps, n).detach().float() for n in _COMPONENTS]) if comps is not None
                    else torch.zeros(len(_COMPONENTS), device=self.device))
            total, lm_ce, sdpo, replay = self.local.sum_(mine).unbind()
            comps = LossComponents(total, lm_ce, sdpo, replay)
        assert comps is not None
        return comps

    def _record_divergence(self, total: torch.Tensor) -> torch.Tensor:
        """Note on the device whether ``total`` is not finite (the first such step of the round and
        its loss) and, from then on, skip the inner updates; returns the device flag of this step."""
        bad = ~torch.isfinite(total.detach())
        first = bad & (self._diverged_at < 0)
        self._diverged_at.masked_fill_(first, self.inner_steps)
        self._diverged_loss.copy_(torch.where(first, total.detach().float(), self._diverged_loss))
        self._skip.copy_(self._diverged_at >= 0)
        return bad

    def _check_divergence(self) -> None:
        """Once per round, before the pseudo-gradient is handed over: if a loss of the round was not
        finite, abstain from the round (see _after_abstention) and start the record afresh."""
        at, loss = torch.stack([self._diverged_at.double(), self._diverged_loss.double()]).tolist()
        if at < 0:
            return
        if self.manager.abstain_reason is None:
            self.manager.abstain_reason = (
                f"loss is {loss} at inner step {int(at)}; lower inner.lr or raise inner.warmup_steps"
            )
            logger.warning("rank %d: %s; abstaining from round %d", self.rank, self.manager.abstain_reason,
                           self.manager.current_step())
        self._diverged_at.fill_(-1)
        self._skip.zero_()

    # ------------------------------------------------------------------ per-round bookkeeping
    def _after_round(self, round_: int, seg: _Segment, record: ExchangeRecord | None, committed: bool) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # wall and tokens/s count the round's queued work
        wall = time.monotonic() - seg.start
        blocked = record.blocked_s if record else 0.0
        if record is not None:
            up, down = record.replica_bytes or (record.bytes_up, record.bytes_down)
            self.bytes_up += up  # the heartbeat counts the whole replica, all its devices
            self.bytes_down += down
        outer_done = committed and self.manager.current_step() % self.fragments == 0
        outer_round = self.manager.current_step() // self.fragments
        if self.planner is not None and self.planner.rule is not None and committed:
            self.planner.observe(seg.steps, record, wall - blocked)  # rank 0: the next round's H, before
            if self.manager.current_step() < self.total_rounds:  # it evaluates (the others wait for it)
                self.planner.ensure(self.manager.current_step() + 1)  # (round r+1's is stored already)
        eval_loss = None
        # FSDP: the forward is a collective, every local process of replica 0 evaluates
        if outer_done and self.rank == 0 and (self.leader or self.fsdp) and self._due(self.cfg.eval_every,
                                                                                          outer_round):
            self._heartbeat(HEARTBEAT_EVALUATING)
            eval_loss = self.evaluate()
        metrics = self._round_metrics(round_, seg, record, committed, wall, blocked, eval_loss)
        if self.leader:
            self._reports().put(metrics_key(self.rank, round_), metrics_bytes(self.rank, round_, metrics))
        self.metrics.append(metrics)
        self._heartbeat(HEARTBEAT_TRAINING, loss=metrics.get("total"))
        if outer_done and self._due(self.cfg.checkpoint_every, outer_round):
            self.checkpoint(record)
        self._outer_done = outer_done

    def _due(self, every: int, outer_round: int) -> bool:
        """True every ``every`` outer rounds and after the last round (``every == 0``: last only)."""
        last = self.manager.current_step() >= self.total_rounds
        if self.planner is not None:  # inner.sync_every = "auto": every `every` x sync_every inner steps
            return last or (every > 0 and self.planner.crossed(self.manager.current_step() - 1, every))
        return last or (every > 0 and outer_round % every == 0)

    def _round_metrics(
        self,
        round_: int,
        seg: _Segment,
        record: ExchangeRecord | None,
        committed: bool,
        wall: float,
        blocked: float,
        eval_loss: float | None,
    ) -> dict[str, Any]:
        inner_s = max(0.0, wall - blocked)
        means, tokens = seg.read()
        out: dict[str, Any] = {
            "attempt": self.attempt,
            "fragment": round_ % self.fragments,
            "outer_round": round_ // self.fragments,
            "committed": committed,
            "inner_steps": seg.steps,
            "inner_step_total": self.inner_steps,
            **means,
            "tokens": tokens,
            "tokens_per_s": tokens / inner_s if inner_s > 0 else 0.0,
            "wall_s": wall,
            "inner_s": inner_s,
            "wait_s": blocked,
            "data_wait_s": self.data.reset_data_wait(),  # the inner loop waiting for batches
            "data_bad_rows": self.data.bad_rows,  # unusable rows skipped so far (data.max_bad_fraction)
            "lr": self.inner.param_groups[0]["lr"],
            "devices": self.local.size if self.local is not None else 1,
            "sync_every": seg.steps if self.planner is not None else self.rep.inner_steps_per_round,
            **self.steps.round_metrics(inner_s),  # RL: rewards, completion length, generation share
        }
        if record is not None:
            out.update(
                exchange_s=record.exchange_s,
                # the replica's bytes (all its devices); device_bytes_*: this process's (one device's)
                bytes_up=(record.replica_bytes or (record.bytes_up, 0))[0],
                bytes_down=(record.replica_bytes or (0, record.bytes_down))[1],
                device_bytes_up=record.bytes_up,
                device_bytes_down=record.bytes_down,
                participants=record.participants,
                late=record.late,
                error=record.error,
                abstained=record.abstained,
            )
        if eval_loss is not None:
            out["eval_loss"] = eval_loss
        plan = self.planner.plans.get(round_) if self.planner is not None else None
        if plan is not None:  # what rank 0 decided this round's H from
            out.update(sync_every=plan.h, sync_every_reason=plan.reason, sync_every_compute_s=plan.compute_s,
                       sync_every_exchange_s=plan.exchange_s, sync_every_tau=plan.tau)
        return out

    def _steps_before(self, round_: int) -> int:
        """Inner steps of the run before round ``round_`` (``inner.sync_every = "auto"``: from the plans)."""
        if self.planner is not None:
            return self.planner.steps_before(round_)
        return max(0, round_) * self.rep.inner_steps_per_round

    def _set_rounds(self, rounds: int) -> None:
        self.total_rounds = min(self.total_rounds, rounds)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean ``lm_ce`` of the global model on the held-out split (the live parameters are restored)."""
        live = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        params = dict(self.model.named_parameters())
        self.rep.reset_to_global()  # the global parameters (with FSDP: this process's shards of them)
        was_training = self.model.training
        self.model.eval()
        with autocast(self.cfg.model, self.device):
            losses = list(self.steps.eval_losses(self.model))  # lm_ce; RL: minus the mean reward
        self.model.train(was_training)
        for n, t in live.items():
            params[n].copy_(t)
        self.last_eval = sum(losses) / max(1, len(losses))
        return self.last_eval

    def checkpoint(self, record: ExchangeRecord | None) -> None:
        """Write this rank's shard of the global checkpoint of the last round; prune what it makes obsolete."""
        self._heartbeat(HEARTBEAT_CHECKPOINTING)
        self._save_state(takeover_s=min(60.0, self.cfg.exchange.straggler_timeout_s))
        participants = record.participants if record and record.participants else [0]
        round_ = self.manager.current_step() - 1
        if self.rank == min(participants):
            self._prune(round_)

    def _save_state(self, *, takeover_s: float) -> None:
        """This rank's own state and its part of the global checkpoint of the last round (all missing
        shards after ``takeover_s``); times the save for the deadline estimate."""
        start = time.monotonic()
        round_ = self.manager.current_step() - 1
        tensors, meta = self.rep.state_tensors()  # every local process: the outer momentum is gathered
        buffers = gather_buffers(self.manager, self.local, self.fragments)  # every local process: its slice's
        own_state = self._replica_state(buffers) if self.fsdp else None  # FSDP: the inner AdamW state is gathered
        if not self.leader:  # the global state is then whole on every local process: local rank 0 saves it
            self._saved_round = round_  # as the leader does: _continue_later's collective calls must match
            return
        own, doc = own_state or self._replica_state(buffers)
        ckpt.save_replica_state(self.store, round_, self.rank, own, doc, self.run_key)
        ckpt.save_checkpoint(
            self.store,
            round_,
            self.manager.current_step(),
            tensors,
            meta,
            rank=self.rank,
            world_size=self.cfg.replicas,
            data_state=self.data.state_dict(),
            takeover_s=takeover_s,
            run_key=self.run_key,
        )
        self._saved_round = round_
        if self.deadline is not None:
            self.deadline.record_save(time.monotonic() - start)

    # ------------------------------------------------------------------ the attempt's deadline
    def _deadline_near(self) -> bool:
        """After a round: True when it ended an outer round, the run is not over, and the next outer
        round would not finish before this attempt's deadline (records the round's wall time)."""
        if self.deadline is None or not self._outer_done:
            return False
        now = time.monotonic()
        self.deadline.record_round(now - self._outer_start)
        self._outer_start = now
        stop = self.manager.current_step() < self.total_rounds and self.deadline.should_stop()
        if self.local is not None:  # one decision for the replica: local rank 0's
            stop = bool(self.local.leader_int(int(stop)))
        return stop

    def _continue_later(self) -> TrainResult:
        """End this attempt before its deadline so that a fresh one resumes exactly: this rank's state
        and the global checkpoint of the last round (every shard this rank finds missing: the others
        are training on, so nobody else may write it), a ``continuing`` heartbeat, one log line."""
        assert self.deadline is not None
        round_ = self.manager.current_step() - 1
        why = self.deadline.describe()
        if self._saved_round != round_:  # a checkpoint round has it already
            self._heartbeat(HEARTBEAT_CHECKPOINTING)
            self._save_state(takeover_s=0.0)
        message = (f"attempt {self.attempt} stopped after round {round_} before its platform deadline ({why}); "
                   "state saved, a fresh attempt continues from it")
        logger.warning("rank %d: %s", self.rank, message)
        self._heartbeat(HEARTBEAT_CONTINUING, message=message)
        self.manager.shutdown()
        return TrainResult(self.rank, self.manager.current_step(), self.trained, self.replayed, False,
                           self.last_eval, self.metrics, continuing=True)

    def _prune(self, round_: int) -> None:
        """Delete rounds and checkpoints that checkpoint ``round_`` made obsolete. Cleanup never stops
        a replica: a store error is logged, and the next checkpoint's pruning (which removes
        everything older than it) picks up what this one left."""
        try:
            keep = self.cfg.exchange.keep_rounds
            if keep is not None:  # each local process prunes its own slice of the rounds
                self.manager.prune(min(round_ + 1, self.manager.current_step() - keep))
            if not self.leader:
                return
            older = [r for r in ckpt.complete_rounds(self.store, self.run_key) if r < round_]
            if older:
                ckpt.prune_checkpoints(self.store, older[-1])
        except StoreError as exc:
            self.prune_failures += 1
            logger.warning("rank %d: pruning after checkpoint %d failed (retried after the next one): %s",
                           self.rank, round_, one_line(str(exc)))

    def _finish(self) -> TrainResult:
        apply_last_update(self.rep)  # outer.delay, when the last round was replayed or loaded: once
        self.rep.reset_to_global()
        eval_loss = self.last_eval
        self._heartbeat(HEARTBEAT_CHECKPOINTING)
        whole = full_state_dict(self.model, self.local) if self.fsdp else None  # type: ignore[arg-type]
        written = self.leader and write_final(
            self.store, self.model, self.tokenizer, rank=self.rank, attempt=self.attempt, state_dict=whole,
            run_key=self.run_key,
        )
        self._heartbeat(HEARTBEAT_DONE)
        self.manager.shutdown()
        return TrainResult(
            self.rank, self.manager.current_step(), self.trained, self.replayed, written, eval_loss, self.metrics
        )

    def _heartbeat(self, state: str, *, loss: float | None = None, message: str | None = None) -> None:
        if not self.leader:
            return
        if loss is not None and not math.isfinite(loss):
            loss = None
        hb = Heartbeat(
            rank=self.rank,
            round=self.manager.current_step(),
            step=self.inner_steps,
            loss=loss,
            attempt=self.attempt,
            state=state,
            bytes_up=self.bytes_up,
            bytes_down=self.bytes_down,
            message=message if message is not None else self._note,
            rl=rl_summary(self.metrics[-1]) if self.metrics else None,  # an RL run's last round: reward, KL, ...
        )
        try:
            self._reports().put(member_key(self.rank), heartbeat_bytes(hb))
            if state in _LAST_STATES:  # the attempt ends: wait until this, the last report, is written
                self._close_reports()
        except Exception as exc:
            logger.warning("rank %d: heartbeat failed: %s", self.rank, exc)

    def _reports(self) -> ReportWriter:
        """The background writer of this replica's heartbeats and metrics (see trainer/reports.py)."""
        if self._report_writer is None:
            self._report_writer = ReportWriter(self.store, member_key(self.rank), name=f"diloco-reports-r{self.rank}")
        return self._report_writer

    def _close_reports(self) -> None:
        """Wait (at most the store's timeout) until everything queued is written, then stop the writer.
        On a timeout its thread goes on writing, in order, while the process lives."""
        writer, self._report_writer = self._report_writer, None
        if writer is not None and not writer.close(timeout_s=self.store.retry.timeout_s):
            logger.warning("rank %d: %d heartbeat or metrics writes still pending after %.0f s",
                           self.rank, writer.pending(), self.store.retry.timeout_s)


def _never(_round: int) -> bool:
    return False


#: heartbeats that end an attempt: the last report, waited for
_LAST_STATES = (HEARTBEAT_DONE, HEARTBEAT_FAILED, HEARTBEAT_CONTINUING)
