"""``diloco plot``: per-replica training loss and eval loss curves from a run's metrics (matplotlib Agg).

The plot shows the language-model cross-entropy (``lm_ce``) of each replica's training batches
when the metrics carry it, so the curves compare directly with the eval loss (the held-out LM
cross-entropy of the global model); ``compose_loss``'s total is what ``diloco status`` shows.

Input is what replicas write to ``<run>/metrics/rank-<r>/<round>.json``: one JSON object per
rank per round. Keys are read tolerantly (see :func:`train_loss_of` / :func:`eval_loss_of`) so
the plot survives additions to the metrics record.

Metrics come from the bucket: a value of the wrong type is left out of the curves (never raises),
and :func:`metrics_notes` names it.

Failure: a run with no metrics raises ``ValueError("... has no metrics yet ...")``; a missing
matplotlib raises ``ImportError`` naming the ``plot`` extra.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: Training-loss keys, in order of preference for the plot: the language-model cross-entropy first,
#: so the per-replica curves are comparable with the eval loss (also an LM cross-entropy).
_PLOT_KEYS = ("lm_ce", "loss", "train_loss", "total")
#: Training-loss keys for "the loss" of a round (status): compose_loss's total first.
_TRAIN_KEYS = ("loss", "train_loss", "total", "lm_ce")
_EVAL_KEYS = ("eval_loss", "eval/loss", "val_loss")

Metrics = Mapping[int, Sequence[Mapping[str, Any]]]


def as_number(value: Any) -> float | None:
    """``value`` as a float when it is a JSON number that fits one (not a bool, not a 400-digit int)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        return float(value)
    except OverflowError:
        return None


def _first(record: Mapping[str, Any], keys: Sequence[str]) -> float | None:
    for key in keys:
        value = as_number(record.get(key))
        if value is not None:
            return value
    return None


def train_loss_of(record: Mapping[str, Any]) -> float | None:
    """The training loss in one metrics record, or None."""
    return _first(record, _TRAIN_KEYS)


def eval_loss_of(record: Mapping[str, Any]) -> float | None:
    """The eval loss in one metrics record (``eval_loss`` or ``eval: {loss: ...}``), or None."""
    value = _first(record, _EVAL_KEYS)
    nested = record.get("eval")
    if value is None and isinstance(nested, Mapping):
        value = _first(nested, ("loss", "total", "lm_ce"))
    return value


def _x_of(record: Mapping[str, Any], index: int) -> float:
    for key in ("round", "step"):
        value = as_number(record.get(key))
        if value is not None and math.isfinite(value):
            return value
    return float(index)


#: Values replicas write for non-finite losses (JSON has no NaN): a diverged loss, not a bad field.
_NONFINITE_TEXT = frozenset({"nan", "inf", "-inf"})
#: Most notes :func:`metrics_notes` returns; the rest are counted in one last line.
MAX_NOTES = 10


def metrics_notes(metrics: Metrics) -> list[str]:
    """One line per metrics field that is present but unusable (not a number, a round that is not
    an integer), e.g. ``rank 2: metrics field 'loss' of round 3 is not a number``; such values are
    left out of the curves. Metrics come from the bucket, so nothing here trusts their types."""
    notes: list[str] = []
    for rank, records in sorted(metrics.items()):
        for rec in records:
            if not isinstance(rec, Mapping):
                continue
            rnd = rec.get("round")
            ok_round = isinstance(rnd, int) and not isinstance(rnd, bool) and 0 <= rnd < 10**8
            where = f"of round {rnd}" if ok_round else "of a record"
            if "round" in rec and not ok_round:
                notes.append(f"rank {rank}: metrics field 'round' is not an integer")
            for key in dict.fromkeys((*_PLOT_KEYS, *_TRAIN_KEYS, *_EVAL_KEYS)):
                value = rec.get(key)
                if value is None or (isinstance(value, str) and value in _NONFINITE_TEXT):
                    continue
                if as_number(value) is None:
                    notes.append(f"rank {rank}: metrics field '{key}' {where} is not a number")
    if len(notes) > MAX_NOTES:
        notes[MAX_NOTES - 1:] = [f"... and {len(notes) - MAX_NOTES + 1} more unusable metrics fields"]
    return notes


def curves(metrics: Metrics, *, train_keys: Sequence[str] = _TRAIN_KEYS
           ) -> tuple[dict[int, list[tuple[float, float]]], list[tuple[float, float]]]:
    """(per-rank training curves, eval curve), each a list of (round, loss) sorted by round.

    The eval curve averages the eval losses that ranks report for the same round (usually only
    one rank evaluates). ``train_keys`` picks the training loss (first key present wins).
    """
    train: dict[int, list[tuple[float, float]]] = {}
    evals: dict[float, list[float]] = {}
    for rank, records in sorted(metrics.items()):
        for i, rec in enumerate(records):
            x = _x_of(rec, i)
            loss = _first(rec, train_keys)
            if loss is not None:
                train.setdefault(rank, []).append((x, loss))
            ev = eval_loss_of(rec)
            if ev is not None:
                evals.setdefault(x, []).append(ev)
    eval_curve = sorted((x, sum(v) / len(v)) for x, v in evals.items())
    return {r: sorted(pts) for r, pts in train.items()}, eval_curve


def last_eval_loss(metrics: Metrics) -> float | None:
    """The eval loss of the latest round that has one, or None."""
    _, eval_curve = curves(metrics)
    return eval_curve[-1][1] if eval_curve else None


def plot_losses(metrics: Metrics, out: str | Path, *, title: str = "") -> Path:
    """Write a PNG with one line per replica's training loss and the eval loss; return its path."""
    train, eval_curve = curves(metrics, train_keys=_PLOT_KEYS)
    if not train and not eval_curve:
        raise ValueError(f"run {title or '?'} has no metrics yet; wait for the first round to finish")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError as e:  # pragma: no cover - matplotlib is in the dev extra
        raise ImportError("diloco plot needs matplotlib: pip install 'diloco-serverless[plot]'") from e
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    try:
        for rank, pts in train.items():
            ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1.2, alpha=0.8,
                    label=f"rank {rank} train", marker="." if len(pts) < 30 else None)
        if eval_curve:
            ax.plot([p[0] for p in eval_curve], [p[1] for p in eval_curve], lw=2.5,
                    color="black", marker="o", label="eval")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("round")
        ax.set_ylabel("LM cross-entropy" if any("lm_ce" in r for rs in metrics.values() for r in rs) else "loss")
        ax.set_title(f"DiLoCo {_plain_title(title)}".strip())
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)
    return path


def _plain_title(title: str) -> str:
    """``title`` as matplotlib should draw it: no mathtext (``$``), no control characters."""
    return "".join(c if c.isprintable() else "?" for c in str(title)).replace("$", r"\$")[:120]
