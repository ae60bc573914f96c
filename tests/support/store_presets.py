"""How real object stores behave, as parameters for the store emulation (benchmarks and tests).

One :class:`StorePreset` per store class. The numbers are the published guidance (or, where a vendor
publishes none, a stated assumption); docs/exchange.md ("Real-store emulation") gives each source.
The emulating proxy (:mod:`support.store_emulator`) and the scale simulation both read these, so the
two cannot disagree about what "s3-standard" means.

- ``first_byte_ms``: per-request time to first byte, lognormal with this median and ``p99``
  (``first_byte_p99_ms``): the long tail of real stores.
- ``conn_mb_s``: what one connection (one request) moves per second; a large object on one request
  is slow unless split into parallel parts.
- ``client_mb_s``: the per-client (per-replica NIC) aggregate cap over all its connections.
- ``put_rate`` / ``get_rate``: requests per second per key prefix (the first
  ``prefix_depth`` path components below the bucket) before the store answers 503 SlowDown.
- ``usd_per_1k_put`` / ``usd_per_1k_get`` / ``usd_per_gb_egress``: list prices, for store spend.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class StorePreset:
    """Latency, bandwidth, request-rate limits and prices of one object-store class."""

    name: str
    first_byte_ms: float
    first_byte_p99_ms: float
    conn_mb_s: float
    client_mb_s: float
    put_rate: float
    get_rate: float
    prefix_depth: int
    usd_per_1k_put: float
    usd_per_1k_get: float
    usd_per_gb_egress: float
    source: str

    @property
    def sigma(self) -> float:
        """The lognormal shape giving ``first_byte_p99_ms`` at the 99th percentile (z = 2.326)."""
        return max(0.0, math.log(self.first_byte_p99_ms / self.first_byte_ms) / 2.326)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


#: Amazon S3 Standard, same region. First byte: "100-200 ms" for small objects in the S3 performance
#: guidelines (we take a 60 ms median and a 250 ms p99, what same-region clients measure); 3,500
#: PUT/COPY/POST/DELETE and 5,500 GET/HEAD per second per partitioned prefix ("Best practices design
#: patterns: optimizing Amazon S3 performance"); ~90 MB/s per connection (the guidelines' advice to
#: use byte-range GETs of 8-16 MB across connections to reach the NIC); 10 Gbit/s per client, a
#: typical GPU container NIC. Prices: S3 Standard us-east-1 list prices ($0.005 per 1k PUT, $0.0004
#: per 1k GET, $0 in-region transfer; $0.09/GB is internet egress, charged when replicas are outside AWS).
S3_STANDARD = StorePreset(
    name="s3-standard", first_byte_ms=60.0, first_byte_p99_ms=250.0, conn_mb_s=90.0, client_mb_s=1250.0,
    put_rate=3500.0, get_rate=5500.0, prefix_depth=2, usd_per_1k_put=0.005, usd_per_1k_get=0.0004,
    usd_per_gb_egress=0.09,
    source="AWS S3 performance guidelines and design patterns; S3 Standard us-east-1 list prices",
)

#: Google Cloud Storage Standard, regional. GCS documents ~1,000 object writes and 5,000 reads per
#: second initially per bucket, ramping up ("Request rate and access distribution guidelines"); we
#: apply them per prefix as the emulation's unit. Latency: 40 ms median, 200 ms p99 (regional
#: clients); 100 MB/s per connection. Prices: Class A $0.005 per 1k, Class B $0.0004 per 1k.
GCS_STANDARD = StorePreset(
    name="gcs-standard", first_byte_ms=40.0, first_byte_p99_ms=200.0, conn_mb_s=100.0, client_mb_s=1250.0,
    put_rate=1000.0, get_rate=5000.0, prefix_depth=2, usd_per_1k_put=0.005, usd_per_1k_get=0.0004,
    usd_per_gb_egress=0.12,
    source="GCS request rate and access distribution guidelines; GCS Standard list prices",
)

#: Cloudflare R2. Cloudflare publishes no per-prefix limits; we assume S3's, with a higher first-byte
#: latency from outside Cloudflare's network (80 ms median, 400 ms p99) and 80 MB/s per connection.
#: Prices: Class A $4.50 per million, Class B $0.36 per million, no egress fee.
R2 = StorePreset(
    name="r2", first_byte_ms=80.0, first_byte_p99_ms=400.0, conn_mb_s=80.0, client_mb_s=1250.0,
    put_rate=3500.0, get_rate=5500.0, prefix_depth=2, usd_per_1k_put=0.0045, usd_per_1k_get=0.00036,
    usd_per_gb_egress=0.0,
    source="Cloudflare R2 pricing; rate limits and latency assumed (none published)",
)

PRESETS: dict[str, StorePreset] = {p.name: p for p in (S3_STANDARD, GCS_STANDARD, R2)}


def preset(name: str) -> StorePreset:
    """The preset called ``name``; ValueError naming the known ones otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown store preset {name!r}; use one of {', '.join(PRESETS)}") from None
