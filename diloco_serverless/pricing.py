"""GPU price table and spend estimates for ``diloco launch --max-usd`` and ``diloco status``.

Prices are list prices in USD per replica-hour for the GPU (or Hub hardware flavor) alone, as
published by Modal (https://modal.com/pricing, per-second GPU rates x 3600) and Hugging Face
(https://huggingface.co/pricing, Jobs/Spaces hardware) in late 2026. They are *estimates*: Modal
also bills CPU and memory, both providers change prices, and a replica waiting in a queue may or
may not be billed. Local replicas cost nothing.

Failure: an unknown executor kind or GPU type raises :class:`UnknownGPU` (a ``ValueError``)
whose message lists the known names, so the CLI can print it as a one-line fix.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

#: Modal GPU types (``gpu=`` strings, case-insensitive; ``"H100:2"`` means two per replica).
MODAL_USD_PER_HOUR: dict[str, float] = {
    "T4": 0.59,
    "L4": 0.80,
    "A10G": 1.10,
    "L40S": 1.95,
    "A100": 2.10,
    "A100-40GB": 2.10,
    "A100-80GB": 2.50,
    "H100": 3.95,
    "H200": 4.54,
    "B200": 6.25,
}

#: Hugging Face Jobs hardware flavors (``flavor=`` strings, exact).
HF_JOBS_USD_PER_HOUR: dict[str, float] = {
    "cpu-basic": 0.0,
    "cpu-upgrade": 0.03,
    "t4-small": 0.40,
    "t4-medium": 0.60,
    "l4x1": 0.80,
    "l4x4": 3.80,
    "l40sx1": 1.80,
    "l40sx4": 8.30,
    "l40sx8": 23.50,
    "a10g-small": 1.00,
    "a10g-large": 1.50,
    "a10g-largex2": 3.00,
    "a10g-largex4": 5.00,
    "a100-large": 2.50,
    "h100": 4.50,
    "h100x8": 36.00,
}

PRICE_TABLES: dict[str, Mapping[str, float]] = {
    "local": {"cpu": 0.0},
    "modal": MODAL_USD_PER_HOUR,
    "hf-jobs": HF_JOBS_USD_PER_HOUR,
}

DEFAULT_GPU: dict[str, str] = {"local": "cpu", "modal": "A100", "hf-jobs": "a10g-large"}


class UnknownGPU(ValueError):
    """A GPU type or flavor that the price table (and so the executor) does not know."""


def _choices(names: Iterable[str]) -> str:
    return ", ".join(sorted(names))


def normalize_gpu(kind: str, gpu: str | None) -> str:
    """Return the canonical spelling of ``gpu`` for executor ``kind`` (default when ``None``).

    Modal names are case-insensitive and may carry a ``:count`` suffix (``"h100:2"`` ->
    ``"H100:2"``); HF Jobs flavors are exact lower-case names. Raises :class:`UnknownGPU`.
    """
    if kind not in PRICE_TABLES:
        raise UnknownGPU(f"unknown executor {kind!r}; use one of: {_choices(PRICE_TABLES)}")
    if gpu is None or gpu == "":
        return DEFAULT_GPU[kind]
    if kind == "local":
        if gpu.lower() != "cpu":
            raise UnknownGPU(f"the local executor runs on CPU; drop --gpu (got {gpu!r})")
        return "cpu"
    if kind == "modal":
        return _normalize_modal(gpu)
    if gpu.lower() not in HF_JOBS_USD_PER_HOUR:
        raise UnknownGPU(
            f"unknown HF Jobs flavor {gpu!r}; use one of: {_choices(HF_JOBS_USD_PER_HOUR)}"
        )
    return gpu.lower()


def _normalize_modal(gpu: str) -> str:
    name, _, count = gpu.partition(":")
    canonical = {k.upper(): k for k in MODAL_USD_PER_HOUR}.get(name.upper())
    if canonical is None:
        raise UnknownGPU(f"unknown Modal GPU type {gpu!r}; use one of: {_choices(MODAL_USD_PER_HOUR)}")
    if count:
        if not count.isdigit() or not 1 <= int(count) <= 8:
            raise UnknownGPU(f"bad GPU count in {gpu!r}; write e.g. {canonical}:2 (1 to 8 per replica)")
        return f"{canonical}:{int(count)}"
    return canonical


def usd_per_replica_hour(kind: str, gpu: str | None) -> float:
    """List price of one replica for one hour on ``kind`` with ``gpu`` (validated)."""
    gpu = normalize_gpu(kind, gpu)
    if kind == "modal":
        name, _, count = gpu.partition(":")
        return MODAL_USD_PER_HOUR[name] * (int(count) if count else 1)
    return PRICE_TABLES[kind][gpu]


def estimate_usd(kind: str, gpu: str | None, replica_seconds: Iterable[float]) -> float:
    """Estimated spend: the per-replica hourly price times the summed billed seconds."""
    return usd_per_replica_hour(kind, gpu) * sum(max(0.0, s) for s in replica_seconds) / 3600.0


def would_exceed(
    spent_usd: float, usd_per_hour: float, active_replicas: int, horizon_s: float, max_usd: float
) -> bool:
    """True when the run could cross ``max_usd`` before the next check ``horizon_s`` from now.

    Used by the launch loop to cancel *before* the budget is exceeded: the projected spend is what
    has been spent plus every active replica running for one more polling horizon.
    """
    projected = spent_usd + usd_per_hour * active_replicas * horizon_s / 3600.0
    return projected >= max_usd
