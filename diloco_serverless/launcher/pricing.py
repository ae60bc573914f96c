"""GPU price table and spend estimates for ``diloco launch --max-usd`` and ``diloco status``.

Prices are approximate list prices in USD per replica-hour for the GPU (or Hub hardware flavor)
alone, as published by Modal (https://modal.com/pricing, per-second GPU rates x 3600) and Hugging
Face (https://huggingface.co/pricing, Jobs hardware) in late 2026. They are *estimates*: Modal also
bills CPU and memory, providers change prices, and a replica waiting in a queue may or may not be
billed. Local replicas cost nothing. Which names are valid is decided by the executors
(:mod:`diloco_serverless.executors`); a valid name missing here simply has no estimate (None).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

#: Modal GPU types (``gpu=`` strings; ``"H100:2"`` means two per replica).
MODAL_USD_PER_HOUR: dict[str, float] = {
    "T4": 0.59, "L4": 0.80, "A10": 1.10, "A10G": 1.10, "L40S": 1.95, "A100": 2.10, "A100-40GB": 2.10,
    "A100-80GB": 2.50, "H100": 3.95, "H200": 4.54, "B200": 6.25,
}

#: Hugging Face Jobs hardware flavors (``flavor=`` strings): exactly ``huggingface_hub.JobHardware``'s
#: values (tests/executors/test_executor_hf_jobs.py checks both ways).
HF_JOBS_USD_PER_HOUR: dict[str, float] = {
    "cpu-basic": 0.0, "cpu-upgrade": 0.03, "cpu-performance": 0.05, "cpu-xl": 0.10,
    "t4-small": 0.40, "t4-medium": 0.60, "l4x1": 0.80, "l4x4": 3.80,
    "l40sx1": 1.80, "l40sx4": 8.30, "l40sx8": 23.50,
    "a10g-small": 1.00, "a10g-large": 1.50, "a10g-largex2": 3.00, "a10g-largex4": 5.00,
    "a100-large": 2.50, "a100x4": 10.00, "a100x8": 20.00,
    "h200": 5.00, "h200x2": 10.00, "h200x4": 20.00, "h200x8": 40.00,
    "rtx-pro-6000": 2.60, "rtx-pro-6000x2": 5.20, "rtx-pro-6000x4": 10.40, "rtx-pro-6000x8": 20.80,
}

PRICE_TABLES: dict[str, Mapping[str, float]] = {
    "local": {"cpu": 0.0},
    "modal": MODAL_USD_PER_HOUR,
    "hf-jobs": HF_JOBS_USD_PER_HOUR,
}

#: What each executor runs on when no --gpu/--flavor is given (mirrors the executors' defaults).
DEFAULT_GPU: dict[str, str] = {"local": "cpu", "modal": "A100", "hf-jobs": "a10g-large"}


def usd_per_replica_hour(kind: str, gpu: str | None) -> float | None:
    """List price of one replica-hour on executor ``kind`` with ``gpu``; None when unknown.

    Modal names are case-insensitive, may end in ``!`` or ``+`` (placement variants, same price
    here) and may carry ``:N`` (N GPUs per replica, N times the price).
    """
    table = PRICE_TABLES.get(kind)
    if table is None:
        return None
    if kind == "local":
        return 0.0
    name = gpu or DEFAULT_GPU[kind]
    if kind == "modal":
        base, _, count = name.partition(":")
        price = table.get(base.upper().rstrip("!+"))
        n = int(count) if count.isdigit() else 1
        return None if price is None else price * n
    return table.get(name.lower())


def estimate_usd(usd_per_hour: float, replica_seconds: Iterable[float]) -> float:
    """Estimated spend: the per-replica hourly price times the summed billed seconds."""
    return usd_per_hour * sum(max(0.0, s) for s in replica_seconds) / 3600.0


def would_exceed(
    spent_usd: float, usd_per_hour: float, active_replicas: int, horizon_s: float, max_usd: float
) -> bool:
    """True when the run could cross ``max_usd`` before the next check ``horizon_s`` from now.

    Used by the launch loop to cancel *before* the budget is exceeded: the projected spend is what
    has been spent plus every active replica running for one more polling horizon.
    """
    projected = spent_usd + usd_per_hour * active_replicas * horizon_s / 3600.0
    return projected >= max_usd
