"""Wiring of ``torchft.local_sgd.DiLoCo`` for the object-store manager: fragments, outer optimizers, replay.

DiLoCo (arXiv 2311.08105) runs H inner steps per replica, then averages the pseudo-gradients
``theta_global - theta_local`` and applies an outer Nesterov-SGD step; Streaming DiLoCo
(arXiv 2501.18512) splits the model into fragments synced at staggered steps, optionally overlapping
a fragment's exchange with ``fragment_sync_delay`` inner steps. torchft implements both; this module
builds it so that

* each fragment's pseudo-gradient travels as **one flat buffer** (one exchange round per fragment
  sync): torchft's bucketization with a bucket at least as large as the largest fragment. Smaller
  buckets hit a torchft bug (a tensor crossing a bucket boundary is never reduced), which
  ``tests/trainer/test_diloco_buckets.py`` demonstrates and guards against;
* ``fragment_update_alpha = 0``: after a sync the fragment's parameters are exactly the new global
  parameters, identical on every replica;
* a replica can **replay** a stored reduced round through the very same torchft code path
  (:meth:`DiLoCoReplica.replay_round`), so a restarted or late replica reaches bit-identical global
  state (same inputs, same ops, same order);
* the global state (fragment global parameters, outer optimizer state, manager step) is a flat dict
  of tensors plus JSON metadata, ready for safetensors checkpoints (:meth:`DiLoCoReplica.state_tensors`).

This relies on torchft internals of the pinned ``torchft-nightly==2026.10.26`` (``DiLoCo._fragments``,
``_local_step``, fragment ``prepare_sync``/``perform_sync``/``restore_parameters``); a torchft upgrade
must re-run ``tests/trainer/test_diloco*.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torchft.local_sgd import DiLoCo

from diloco_serverless.errors import CheckpointError
from diloco_serverless.trainer.manager import ManagerBase

__all__ = ["CheckpointMismatch", "DiLoCoReplica", "ParamFragment", "build_diloco", "split_fragments"]


class CheckpointMismatch(CheckpointError, ValueError):
    """A checkpoint's tensors do not fit this model (shapes, names or fragment count differ)."""


class ParamFragment(nn.Module):
    """A model fragment: a contiguous group of the model's parameters (shared, not copied).

    ``names`` maps the fragment's parameter names (dots replaced by ``__``) to the model's names.
    """

    def __init__(self, named: Sequence[tuple[str, nn.Parameter]]) -> None:
        super().__init__()
        self.names: dict[str, str] = {}
        for name, param in named:
            local = name.replace(".", "__")
            self.register_parameter(local, param)
            self.names[local] = name


def split_fragments(model: nn.Module, fragments: int) -> list[ParamFragment]:
    """Split ``model``'s parameters, in order, into ``fragments`` contiguous groups of similar size.

    Raises ValueError when the model has fewer parameter tensors than fragments.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if len(named) < fragments:
        raise ValueError(f"model has {len(named)} parameter tensors, cannot split into {fragments} fragments")
    total = sum(p.numel() for _, p in named)
    groups: list[list[tuple[str, nn.Parameter]]] = [[]]
    done = 0
    for i, (name, param) in enumerate(named):
        left_tensors, left_groups = len(named) - i, fragments - len(groups)
        target = total * len(groups) / fragments
        if groups[-1] and left_groups > 0 and (done >= target or left_tensors <= left_groups):
            groups.append([])
        groups[-1].append((name, param))
        done += param.numel()
    return [ParamFragment(g) for g in groups]


def _fragment_bytes(fragment: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in fragment.parameters())


def build_diloco(manager: ManagerBase, model: nn.Module, inner_optimizer: torch.optim.Optimizer, *,
                 sync_every: int, fragments: int = 1, fragment_sync_delay: int = 0,
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, nesterov: bool = True,
                 bucket_cap_mb: float | None = None) -> DiLoCoReplica:
    """Build torchft's DiLoCo over ``model`` with one flat exchange buffer per fragment.

    ``sync_every`` is H (inner steps between two syncs of the same fragment); it must be a multiple
    of ``fragments`` and ``fragment_sync_delay < sync_every / fragments`` (torchft raises otherwise).
    ``bucket_cap_mb`` overrides the bucket size (tests only: a smaller bucket triggers torchft's
    boundary bug).
    """
    if manager.fragments != fragments:
        raise ValueError(f"manager was built for {manager.fragments} fragments, DiLoCo for {fragments}; pass the same")
    parts = split_fragments(model, fragments)
    outer: list[torch.optim.Optimizer] = [
        torch.optim.SGD(p.parameters(), lr=outer_lr, momentum=outer_momentum, nesterov=nesterov) for p in parts
    ]
    if bucket_cap_mb is None:
        bucket_cap_mb = max(_fragment_bytes(p) for p in parts) / 2**20 + 1.0
    diloco = DiLoCo(manager, list(parts), inner_optimizer, outer, sync_every=sync_every,
                    pin_memory=False, use_bucketization=True, bucket_cap_mb=bucket_cap_mb,
                    fragment_sync_delay=fragment_sync_delay, fragment_update_alpha=0.0)
    return DiLoCoReplica(manager, model, diloco, parts, outer)


class DiLoCoReplica:
    """One replica's DiLoCo state: the torchft object plus replay and checkpoint helpers."""

    def __init__(self, manager: ManagerBase, model: nn.Module, diloco: DiLoCo,
                 fragments: list[ParamFragment], outer_optimizers: list[torch.optim.Optimizer]) -> None:
        self.manager, self.model, self.diloco = manager, model, diloco
        self.fragments, self.outer_optimizers = fragments, outer_optimizers

    def __enter__(self) -> DiLoCoReplica:
        self.diloco.__enter__()
        return self

    def __exit__(self, *exc: Any) -> bool:
        return bool(self.diloco.__exit__(*exc))

    @property
    def at_boundary(self) -> bool:
        """True between fragment syncs (no exchange prepared, no partial sync cycle)."""
        return bool(self.diloco._local_step == 0)

    @property
    def inner_steps_per_round(self) -> int:
        """Inner steps between two exchange rounds (H / fragments)."""
        return int(self.diloco._sync_every)

    def current_fragment(self) -> int:
        return self.manager.current_step() % len(self.fragments)

    def flat_like(self, fragment: int) -> torch.Tensor:
        """An empty flat buffer shaped like fragment ``fragment``'s exchanged pseudo-gradient."""
        params = list(self.fragments[fragment].parameters())
        return torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype)

    # -- healing -------------------------------------------------------------------------------
    def replay_round(self) -> bool:
        """Apply the stored reduced result of round ``current_step()`` to its fragment.

        Runs torchft's own ``prepare_sync``/``perform_sync`` with the manager in replay mode, so the
        outer step is computed exactly as on the replicas that took part. The fragment's local
        progress is discarded (its parameters become the new global ones). Returns False (and
        changes nothing) when the round is not stored.
        """
        if not self.at_boundary:
            raise RuntimeError(f"rank {self.manager.rank}: replay only between syncs (local step "
                               f"{self.diloco._local_step})")
        frag = self.current_fragment()
        if self.manager.read_reduced(self.manager.current_step(), self.flat_like(frag)) is None:
            return False
        with self.manager.replaying():
            self.manager.start_quorum()
            fragment = self.diloco._fragments[frag]
            fragment.prepare_sync()
            return bool(fragment.perform_sync())

    def catch_up(self, limit_round: int | None = None) -> int:
        """Replay every stored round from ``current_step()`` on (up to ``limit_round`` exclusive).

        Returns how many rounds were replayed. Stops at the first round not (yet) stored.
        """
        replayed = 0
        while limit_round is None or self.manager.current_step() < limit_round:
            if not self.replay_round():
                break
            replayed += 1
        return replayed

    def reset_to_global(self) -> None:
        """Set every fragment's parameters to its global parameters (drops local progress)."""
        for fragment in self.diloco._fragments:
            fragment.restore_parameters()

    def global_named_parameters(self) -> dict[str, torch.Tensor]:
        """The global parameters by model parameter name (CPU copies)."""
        out: dict[str, torch.Tensor] = {}
        for part, fragment in zip(self.fragments, self.diloco._fragments):
            for local, tensor in fragment.original_parameters.items():
                out[part.names[local]] = tensor.detach().clone()
        return out

    # -- checkpoint state ----------------------------------------------------------------------
    def state_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Global state as ``(tensors, meta)``: torchft's registered fragment state + manager step.

        ``tensors`` maps '/'-joined paths to contiguous CPU tensors; ``meta`` is JSON-safe and has
        the same structure with tensors replaced by ``{"__tensor__": path}``.
        """
        tensors: dict[str, torch.Tensor] = {}
        meta = _flatten(self.manager.manager_state_dict(), "", tensors)
        meta["fragments"] = len(self.fragments)
        return tensors, meta

    def load_state_tensors(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any], *,
                           source: str = "checkpoint") -> None:
        """Load a state from :meth:`state_tensors`; model parameters become the global ones.

        Raises :class:`CheckpointMismatch` naming the parameter when names, shapes or the fragment
        count differ (before anything is modified).
        """
        self.check_compatible(tensors, meta, source=source)
        state = _unflatten({k: v for k, v in meta.items() if k != "fragments"}, tensors)
        self.manager.load_manager_state_dict(state)
        self.reset_to_global()

    def check_compatible(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any], *, source: str) -> None:
        """Raise :class:`CheckpointMismatch` if ``tensors`` cannot be loaded into this model."""
        if meta.get("fragments") != len(self.fragments):
            raise CheckpointMismatch(f"{source} has {meta.get('fragments')} fragments, this run uses "
                                     f"{len(self.fragments)}; keep exchange.fragments as in the run")
        for key, shape in self.global_shapes().items():
            theirs = tensors.get(key)
            name = key.rsplit("/", 1)[-1].replace("__", ".")
            if theirs is None:
                raise CheckpointMismatch(f"{source} lacks parameter {name!r}; the model differs from the run's")
            if tuple(theirs.shape) != shape:
                raise CheckpointMismatch(f"parameter {name!r}: {source} has shape {tuple(theirs.shape)}, the model "
                                         f"has {shape}; use the run's model config")

    def _global_keys(self) -> dict[str, int]:
        """The key :meth:`state_tensors` gives each global parameter, mapped to its fragment's index."""
        return {f"user/StreamingDiLoCoFragment_{frag._fragment_id}/original_parameters/{name}": i
                for i, frag in enumerate(self.diloco._fragments) for name in frag.original_parameters}

    def global_shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape a checkpoint must give each global parameter, by :meth:`state_tensors` key."""
        return {key: tuple(self.diloco._fragments[i].original_parameters[key.rsplit("/", 1)[-1]].shape)
                for key, i in self._global_keys().items()}


def _flatten(obj: Any, prefix: str, out: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj.detach().to("cpu").contiguous().clone()
        return {"__tensor__": prefix}
    if isinstance(obj, dict):
        return {str(k): _flatten(v, f"{prefix}/{k}" if prefix else str(k), out) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_flatten(v, f"{prefix}/{i}", out) for i, v in enumerate(obj)]
    if isinstance(obj, float) and not math.isfinite(obj):
        raise ValueError(f"state entry {prefix} is {obj}; cannot checkpoint a non-finite value")
    return obj


def _unflatten(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            return tensors[obj["__tensor__"]]
        # torch optimizer state dicts are keyed by int parameter index
        return {(int(k) if k.isdigit() else k): _unflatten(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_unflatten(v, tensors) for v in obj]
    return obj


def pseudo_gradient_reference(globals_: dict[str, torch.Tensor],
                              locals_: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Mean over replicas of ``global - local`` per parameter (fp32), for tests and benchmarks."""
    return {k: torch.stack([g.float() - loc[k].float() for loc in locals_]).mean(0) for k, g in globals_.items()}

