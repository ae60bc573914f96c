"""The run's layout in the store: every key a run writes, built in one place.

See docs/architecture.md, "A run in the store".

Keys are relative to the run (``<store_url>/<run_id>``). Rounds are 0-based and zero-padded to 8
digits, shards to 4, so listings sort in order. Every builder refuses a negative or oversized index
with a ``ValueError`` naming it. :mod:`.record` (run.json), :mod:`.members` (heartbeats,
metrics), the exchange and the checkpoints all build their keys here.
"""

from __future__ import annotations

import hashlib
import math
import re

RUN_JSON = "run.json"
RUN_VERSION = 1
MEMBERS_PREFIX = "members"
STARTS_PREFIX = "members/starts"
ROUNDS_PREFIX = "rounds"
CHECKPOINTS_PREFIX = "checkpoints"
LATEST_CHECKPOINT_KEY = "checkpoints/latest.json"
METRICS_PREFIX = "metrics"
LOGS_PREFIX = "logs"
FINAL_PREFIX = "final"
SLICES_PREFIX = "slices"
SYNC_PLAN_PREFIX = "sync_every"
#: Replicas per key prefix of a round's ready markers and quorum copies above 64 (:func:`control_spread`).
REPLICAS_PER_CONTROL_PREFIX = 64
#: Exchange data objects of large runs live under ``x<2 hex>/`` spread prefixes (see :func:`spread_count`).
SPREAD_PREFIX = "x"
#: Most spread prefixes a run uses (two hex digits).
MAX_SPREAD = 256
#: Runs up to this many replicas keep every exchange object under ``rounds/`` (one prefix is far below
#: any store's request-rate limit there).
SPREAD_FROM_REPLICAS = 17


def _check_index(name: str, value: int, digits: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0 or value >= 10**digits:
        raise ValueError(f"{name} must be an int in [0, {10**digits}), got {value!r}")


def fmt_round(round: int) -> str:
    """``3`` -> ``"00000003"`` (rounds are 0-based, zero-padded to 8 digits)."""
    _check_index("round", round, 8)
    return f"{round:08d}"


def fmt_shard(shard: int) -> str:
    """``3`` -> ``"0003"`` (shards zero-padded to 4 digits)."""
    _check_index("shard", shard, 4)
    return f"{shard:04d}"


_TAG_RE = re.compile(r"[0-9a-f]{1,128}")


def _rank(rank: int) -> str:
    _check_index("rank", rank, 6)
    return f"rank-{rank}"


def slice_prefix(slice_: int) -> str:
    """``slices/<slice:02d>``: the exchange of slice g of a multi-device replica (its own ``rounds/``).

    A replica with G local processes (``parallel.devices``) splits every pseudo-gradient into G
    slices; local rank g exchanges slice g under this prefix with local rank g of the other replicas.
    """
    _check_index("slice", slice_, 2)
    return f"{SLICES_PREFIX}/{slice_:02d}"


def round_prefix(round: int) -> str:
    """``rounds/<round:08d>``."""
    return f"{ROUNDS_PREFIX}/{fmt_round(round)}"


def control_spread(world_size: int) -> int:
    """How many key prefixes the ready markers of a round, and the copies of its quorum, are spread over:
    1 up to 64 replicas (the markers under ``rounds/<round>/ready``), then one per
    :data:`REPLICAS_PER_CONTROL_PREFIX` replicas, at most :func:`spread_count` (N = 256: 4, 1,024: 16).
    1,024 replicas that publish small tensors write their markers within one round trip: in one prefix
    that is ~17,000 PUT/s against S3's 3,500 (docs/exchange.md, "Scale")."""
    return min(spread_count(world_size), math.ceil(world_size / REPLICAS_PER_CONTROL_PREFIX))


def ready_prefix(round: int, slot: int = 0, spread: int = 1) -> str:
    """``rounds/<round>/ready`` (list it to see who is ready); with ``spread`` > 1 (:func:`control_spread`)
    the markers of the ranks ``r`` with ``r mod spread == slot`` are under ``x<slot:02x>/<round>/ready``."""
    return f"{round_prefix(round)}/ready" if spread == 1 else f"{_data_prefix(round, spread, slot=slot)}/ready"


def ready_prefixes(round: int, spread: int = 1) -> list[str]:
    """Every folder holding ready markers of ``round`` when they are spread over ``spread`` prefixes."""
    return [ready_prefix(round, k, spread) for k in range(spread)]


def ready_key(round: int, rank: int, tag: str | None = None, spread: int = 1) -> str:
    """``rounds/<round>/ready/rank-<r>.<tag>``, where ``tag`` is the marker's MAC (lower-case hex, see
    ``exchange/quorum.py``, ``marker_tag``), so a replica that knows what rank r's marker must say can
    check it from a listing without reading it; ``rounds/<round>/ready/rank-<r>`` without a tag (markers
    of earlier versions); under ``x<r mod spread>/<round>/ready/`` with ``spread`` > 1. Raises
    ``ValueError`` for a tag that is not 1-128 hex digits."""
    prefix = ready_prefix(round, rank % spread, spread)
    if tag is None:
        return f"{prefix}/{_rank(rank)}"
    if not isinstance(tag, str) or not _TAG_RE.fullmatch(tag):
        raise ValueError(f"a ready marker's tag must be 1-128 lower-case hex digits, got {tag!r}")
    return f"{prefix}/{_rank(rank)}.{tag}"


def vote_key(round: int, rank: int) -> str:
    """``rounds/<round>/votes/rank-<r>``: rank r's create-only vote in a round without a quorum
    (``exchange/votes.py``: flat, or direct with shares cut into pieces): written after all its
    contributions, or a tombstone that leaves r out."""
    return f"{round_prefix(round)}/votes/{_rank(rank)}"


def abstain_key(round: int, rank: int, spread: int = 1) -> str:
    """``rounds/<round>/ready/abstain-<r>``: rank r will not contribute to the round (its values were
    not finite). Beside the ready markers (in rank r's prefix with ``spread`` > 1), so the listing that
    finds who is ready finds it too."""
    _check_index("rank", rank, 6)
    return f"{ready_prefix(round, rank % spread, spread)}/abstain-{rank}"


def quorum_key(round: int) -> str:
    """``rounds/<round>/quorum.json`` (create-only)."""
    return f"{round_prefix(round)}/quorum.json"


def quorum_copy_key(round: int, copy: int, spread: int) -> str:
    """``x<copy:02x>/<round>/quorum.json``: copy ``copy`` of the round's quorum in a spread run (``spread``
    > 1), written by the quorum's writer after its create won, so that the replicas of a large run read
    the quorum from several key prefixes instead of all polling one (``exchange/quorum.py``,
    ``quorum_copies``)."""
    if spread < 2:
        raise ValueError(f"quorum copies exist only in spread runs (spread >= 2), got spread={spread}")
    return f"{_data_prefix(round, spread, slot=copy)}/quorum.json"


def spread_count(world_size: int) -> int:
    """How many key prefixes a run of ``world_size`` replicas spreads its exchange data objects over.

    1 (everything under ``rounds/``) up to 16 replicas; above, the smallest power of two >= N/4,
    at most :data:`MAX_SPREAD` (N = 64 -> 16, 256 -> 64, 1,024 -> 256). Object stores limit request
    rates per key prefix (S3: 3,500 PUT and 5,500 GET per second), and a flat round moves O(N^2)
    objects; spreading them keeps each prefix under its limit (docs/exchange.md, "Prefix spreading").
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if world_size < SPREAD_FROM_REPLICAS:
        return 1
    n = 1
    while n * 4 < world_size and n < MAX_SPREAD:
        n *= 2
    return n


def spread_prefixes(world_size: int) -> list[str]:
    """The data prefixes of a run of ``world_size`` replicas: ``["rounds"]`` or ``["x00", "x01", ...]``."""
    n = spread_count(world_size)
    return [ROUNDS_PREFIX] if n == 1 else [f"{SPREAD_PREFIX}{i:02x}" for i in range(n)]


def _data_prefix(round: int, spread: int, *parts: int | str, slot: int | None = None) -> str:
    """Where a data object of ``round`` lives: ``rounds/<round>`` with one prefix, else
    ``x<hh>/<round>`` with ``hh`` = ``slot`` or a hash of ``parts`` (shard, rank or group), modulo ``spread``."""
    if spread == 1:
        return round_prefix(round)
    if not 1 <= spread <= MAX_SPREAD:
        raise ValueError(f"spread must be between 1 and {MAX_SPREAD}, got {spread}")
    if slot is None:
        digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=4).digest()
        slot = int.from_bytes(digest, "big")
    return f"{SPREAD_PREFIX}{slot % spread:02x}/{fmt_round(round)}"


def round_data_prefixes(round: int, world_size: int) -> list[str]:
    """Every folder holding data objects of ``round`` (delete them all to prune the round)."""
    return [f"{p}/{fmt_round(round)}" for p in spread_prefixes(world_size)]


def contrib_key(round: int, shard: int, rank: int, spread: int = 1) -> str:
    """``rounds/<round>/contrib/<shard:04d>/rank-<r>``; with ``spread`` > 1 (:func:`spread_count`),
    ``x<hh>/<round>/contrib/<shard:04d>/rank-<r>``."""
    return f"{_data_prefix(round, spread, shard, rank)}/contrib/{fmt_shard(shard)}/{_rank(rank)}"


def reduced_prefix(round: int) -> str:
    """``rounds/<round>/reduced`` (list it to see which shards are reduced; unspread runs only)."""
    return f"{round_prefix(round)}/reduced"


def reduced_key(round: int, shard: int, spread: int = 1) -> str:
    """``rounds/<round>/reduced/<shard:04d>`` (create-only); with ``spread`` > 1 under ``x<shard mod
    spread>``: every replica reads every reduced shard, so consecutive shards never share a prefix."""
    _check_index("shard", shard, 4)
    return f"{_data_prefix(round, spread, slot=shard)}/reduced/{fmt_shard(shard)}"


def reduced_copy_key(round: int, shard: int, copy: int, spread: int) -> str:
    """``x<hh>/<round>/reduced/<shard:04d>.copy-<c>``: copy ``copy`` of a small reduced shard of a
    hierarchical round above 64 replicas (``exchange/hierarchical.py``), which every replica reads: one
    copy per 64 readers keeps each prefix under the store's GET rate. ``hh`` = 1 + 16 x shard + copy
    (modulo ``spread``), apart from the first shards' own prefixes."""
    _check_index("shard", shard, 4)
    if spread < 2:
        raise ValueError(f"reduced-shard copies exist only in spread runs (spread >= 2), got spread={spread}")
    return f"{_data_prefix(round, spread, slot=1 + 16 * shard + copy)}/reduced/{fmt_shard(shard)}.copy-{copy}"


def partial_key(round: int, group: int, shard: int, spread: int = 1, level: int = 1) -> str:
    """``rounds/<round>/partial/<group:04d>/<shard:04d>`` (create-only): group ``group``'s sum of
    ``shard`` in a hierarchical round; spread like :func:`contrib_key`. A deeper level of a
    three-level round (groups of groups, ``level`` 2) is ``.../partial/l<level>/<group:04d>/<shard:04d>``."""
    _check_index("group", group, 4)
    if not isinstance(level, int) or isinstance(level, bool) or not 1 <= level <= 9:
        raise ValueError(f"partial level must be an int in [1, 9], got {level!r}")
    if level == 1:
        return f"{_data_prefix(round, spread, shard, 'g', group)}/partial/{fmt_shard(group)}/{fmt_shard(shard)}"
    where = _data_prefix(round, spread, shard, f"g{level}", group)
    return f"{where}/partial/l{level}/{fmt_shard(group)}/{fmt_shard(shard)}"


def code_key(filename: str) -> str:
    """``code/<filename>``: the package the launcher shipped to remote replicas (a wheel). Its SHA-256
    is pinned in each replica's command, so a replaced object is refused, never installed."""
    if not filename or "/" in filename or filename.startswith("."):
        raise ValueError(f"code file name must be a plain file name, got {filename!r}")
    return f"code/{filename}"


def checkpoint_prefix(round: int) -> str:
    """``checkpoints/<round:08d>``: a global checkpoint taken after ``round``."""
    return f"{CHECKPOINTS_PREFIX}/{fmt_round(round)}"


def member_key(rank: int) -> str:
    """``members/rank-<r>.json``: rank r's heartbeat."""
    return f"{MEMBERS_PREFIX}/{_rank(rank)}.json"


def start_prefix(rank: int) -> str:
    """``members/starts/rank-<r>``: one create-only record per start of a rank's replica (every attempt)."""
    return f"{STARTS_PREFIX}/{_rank(rank)}"


def start_key(rank: int, time_ms: int, token: str) -> str:
    """``members/starts/rank-<r>/<time_ms:013d>-<token>.json``: a start at Unix time ``time_ms`` (ms); the
    random ``token`` keeps two starts of the same millisecond apart. Listings sort by time."""
    _check_index("time_ms", time_ms, 13)
    if not token or not token.isalnum():
        raise ValueError(f"start record token must be letters and digits, got {token!r}")
    return f"{start_prefix(rank)}/{time_ms:013d}-{token}.json"


def sync_plan_key(round: int) -> str:
    """``sync_every/<round:08d>.json``: H of ``round`` (``inner.sync_every = "auto"``), decided by rank 0."""
    return f"{SYNC_PLAN_PREFIX}/{fmt_round(round)}.json"


def metrics_prefix(rank: int) -> str:
    """``metrics/rank-<r>``."""
    return f"{METRICS_PREFIX}/{_rank(rank)}"


def metrics_key(rank: int, round: int) -> str:
    """``metrics/rank-<r>/<round:08d>.json``."""
    return f"{metrics_prefix(rank)}/{fmt_round(round)}.json"


def log_key(rank: int) -> str:
    """``logs/rank-<r>.log`` (local executor, file stores)."""
    return f"{LOGS_PREFIX}/{_rank(rank)}.log"


def probe_key(rank: int, attempt: int) -> str:
    """Where attempt ``attempt`` of probe rank ``rank`` of ``diloco doctor`` records itself, under the run."""
    _check_index("attempt", attempt, 6)
    return f"doctor/{_rank(rank)}/attempt-{attempt}.json"
