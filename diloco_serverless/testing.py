"""Test doubles for code that uses diloco-serverless: an in-process torchft ``Manager`` and its group.

    group = MockGroup(world_size=2)
    managers = [MockManager(group, rank) for rank in range(2)]   # one per thread

:class:`MockManager` satisfies everything torchft's ``DiLoCo`` calls, like
:class:`~diloco_serverless.trainer.manager.ObjectStoreManager`, but averages through a
:class:`MockGroup` in memory instead of a store, so replicas can run as threads in one test.
The project's own tests use them; users' tests may too.
"""

from __future__ import annotations

import threading
import time

import torch

from diloco_serverless.trainer.manager import ExchangeRecord, ManagerBase


class MockGroup:
    """In-process rendezvous for :class:`MockManager` replicas running in threads.

    A round completes when every member that has not :meth:`leave`-d has contributed (or its
    contribution is dropped by fault injection); the mean is summed in rank order in fp32, so every
    member gets bit-identical bytes. Reduced rounds are kept for replay.
    """

    def __init__(self, world_size: int, *, timeout_s: float = 60.0) -> None:
        self.world_size, self.timeout_s = world_size, timeout_s
        self._cond = threading.Condition()
        self._members = set(range(world_size))
        self._contrib: dict[int, dict[int, torch.Tensor | None]] = {}
        self.reduced: dict[int, tuple[torch.Tensor, list[int]]] = {}

    def leave(self, rank: int) -> None:
        """Rank stops taking part (a crash): open and future rounds no longer wait for it."""
        with self._cond:
            self._members.discard(rank)
            self._cond.notify_all()

    def join(self, rank: int) -> None:
        with self._cond:
            self._members.add(rank)

    def abstain(self, rank: int, round_: int) -> None:
        """Announce that ``rank`` will not contribute to ``round_`` (a failed exchange); never blocks."""
        with self._cond:
            if round_ not in self.reduced:
                self._contrib.setdefault(round_, {})[rank] = None
                if self._members <= set(self._contrib[round_]):
                    self._reduce(round_)

    def contribute(self, rank: int, round_: int, tensor: torch.Tensor | None) -> tuple[torch.Tensor, list[int]]:
        """Contribute (``None`` = late: announce without data) and block for the round's mean."""
        with self._cond:
            if round_ in self.reduced:
                return self.reduced[round_]
            self._contrib.setdefault(round_, {})[rank] = tensor
            deadline = time.monotonic() + self.timeout_s
            while round_ not in self.reduced:
                got = self._contrib.setdefault(round_, {rank: tensor})
                if self._members <= set(got) and any(t is not None for t in got.values()):
                    self._reduce(round_)
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"MockGroup round {round_}: ranks {sorted(self._members - set(got))} missing")
                self._cond.wait(timeout=min(left, 0.5))
            return self.reduced[round_]

    def _reduce(self, round_: int) -> None:
        got = self._contrib.pop(round_)
        ranks = sorted(r for r, t in got.items() if t is not None)
        if not ranks:  # nobody had data: the round stays open for a later contributor
            self._cond.notify_all()
            return
        present = {r: t for r, t in got.items() if t is not None}
        total = torch.zeros_like(present[ranks[0]], dtype=torch.float32)
        for r in ranks:
            total += present[r].to(torch.float32)
        self.reduced[round_] = ((total / len(ranks)).to(present[ranks[0]].dtype), ranks)
        self._cond.notify_all()


class MockManager(ManagerBase):
    """In-process torchft ``Manager`` stand-in: replicas in threads averaging through a :class:`MockGroup`.

    Fault injection: ``fail_rounds`` = rounds whose exchange raises on this rank (reported, round
    not committed, the others proceed without it); ``drop_rounds`` = rounds where this rank arrives
    late (its contribution is dropped but it receives the mean, like a late object-store replica).
    """

    def __init__(self, group: MockGroup, rank: int, *, min_replicas: int | None = None, fragments: int = 1,
                 fail_rounds: set[int] | None = None, drop_rounds: set[int] | None = None,
                 max_retries: int | None = None) -> None:
        super().__init__(rank, group.world_size, min_replicas=min_replicas, fragments=fragments,
                         max_retries=max_retries)
        self.group = group
        self.fail_rounds = set(fail_rounds or ())
        self.drop_rounds = set(drop_rounds or ())

    def _exchange(self, tensor: torch.Tensor, round_: int, residual_key: str,
                  record: ExchangeRecord) -> torch.Tensor:
        if round_ in self.fail_rounds:
            self.fail_rounds.discard(round_)
            self.group.abstain(self.rank, round_)
            raise ConnectionError(f"injected fault in round {round_} on rank {self.rank}")
        if record.abstained is None and not bool(torch.isfinite(tensor).all()):
            record.abstained = "pseudo-gradient has non-finite values (NaN/Inf)"
        late = round_ in self.drop_rounds or record.abstained is not None
        result, ranks = self.group.contribute(self.rank, round_, None if late else tensor.clone())
        record.participants, record.late = list(ranks), self.rank not in ranks
        record.bytes_up = 0 if late else tensor.numel() * tensor.element_size()
        record.bytes_down = tensor.numel() * tensor.element_size()
        return result.clone()

    def _read_round(self, round_: int, like: torch.Tensor) -> torch.Tensor | None:
        got = self.group.reduced.get(round_)
        return None if got is None else got[0].clone()

    def prune(self, before_round: int) -> None:
        for r in [r for r in self.group.reduced if r < before_round]:
            self.group.reduced.pop(r, None)
