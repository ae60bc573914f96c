"""The robust-aggregation guard of a sparse round: a finite but huge contribution is scaled down to
:data:`CLIP_RATIO` times the median of the round's contribution norms before it is summed.

Covenant-72B (arXiv 2603.08163) scales every peer's update against the median norm so that one
diverging replica or a bad data shard cannot throw the global model off; non-finite contributions
never get here (the replica abstains, :mod:`.votes`). Honest replicas' norms are within a small
factor of each other, so the guard leaves them alone (factor 1, the sum bit-identical to an
unguarded one).

Every replica must scale alike. Each norm is computed in fp64 from the decoded fp32 values and then
rounded to 20 significant bits (:func:`stable_norm`), so that a different summation order on another
CPU (vector width) cannot change it; the median and the factors are then plain Python floats, the
same operations everywhere, and a scaled contribution is multiplied by its factor in fp32, element by
element. Every scaling is logged (rank, norm, median, factor).

A sparse contribution is summed as it was sent (:class:`~diloco_serverless.exchange.sparse.SparseValues`):
its kept values are added at their positions into one fp32 accumulator, in rank order, which gives the
same bits as adding its dense vector (the other entries would add exact zeros), at a sixtieth of the
work and memory at the default density.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Sequence

import torch

from diloco_serverless.exchange.sparse import SparseValues

__all__ = ["CLIP_RATIO", "guard_factors", "guarded_sum", "stable_norm"]

log = logging.getLogger(__name__)

#: A contribution whose norm exceeds this many times the round's median norm is scaled down to it.
CLIP_RATIO = 4.0
_NORM_BITS = 20  # significant bits a norm keeps (see the module docstring)


def stable_norm(values: torch.Tensor | SparseValues) -> float:
    """The L2 norm of ``values`` (fp64, over its non-zero entries: a sparse contribution's 1.6%, in order
    of position, dense or not), rounded to :data:`_NORM_BITS` significant bits."""
    flat = values.values if isinstance(values, SparseValues) else values.reshape(-1)
    x = float(torch.linalg.vector_norm(flat[flat != 0].to(torch.float64)))
    if x == 0.0 or not math.isfinite(x):
        return x
    m, e = math.frexp(x)
    return math.ldexp(round(m * (1 << _NORM_BITS)), e - _NORM_BITS)


def guard_factors(norms: Sequence[float], ratio: float = CLIP_RATIO) -> list[float]:
    """Each contribution's factor: ``ratio * median / norm`` where its norm exceeds ``ratio`` times the
    median of ``norms``, else 1. With fewer than three contributions nothing is scaled (a median of two is
    their mean: it cannot tell which one is off)."""
    if len(norms) < 3:
        return [1.0] * len(norms)
    limit = ratio * statistics.median(norms)
    return [limit / n if n > limit else 1.0 for n in norms]


def guarded_sum(contributions: Sequence[tuple[int, torch.Tensor | SparseValues]], *, what: str) -> torch.Tensor:
    """The fp32 sum, in the given (rank) order, of ``(rank, values)`` contributions (dense or sparse), each
    scaled by its :func:`guard_factors` factor; logs every contribution scaled (``what`` names the round
    and shard)."""
    norms = [stable_norm(v) for _, v in contributions]
    factors = guard_factors(norms)
    median = statistics.median(norms) if norms else 0.0
    acc = torch.zeros(_numel(contributions[0][1]) if contributions else 0, dtype=torch.float32)
    for (rank, values), norm, factor in zip(contributions, norms, factors):
        if factor != 1.0:
            log.warning("%s: the contribution of rank %d has norm %.4g, more than %g x the median %.4g of the "
                        "round's %d; scaled by %.4g (robust-aggregation guard)", what, rank, norm, CLIP_RATIO,
                        median, len(norms), factor)
        if isinstance(values, SparseValues):
            values.add_to(acc, factor)
        elif factor == 1.0:
            acc += values
        else:
            acc += values * factor
    return acc


def _numel(values: torch.Tensor | SparseValues) -> int:
    return values.numel if isinstance(values, SparseValues) else values.numel()
