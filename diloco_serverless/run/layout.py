"""The run's layout in the store: every key a run writes, built in one place.

See docs/architecture.md, "A run in the store".

Keys are relative to the run (``<store_url>/<run_id>``). Rounds are 0-based and zero-padded to 8
digits, shards to 4, so listings sort in order. Every builder refuses a negative or oversized index
with a ``ValueError`` naming it. :mod:`.record` (run.json), :mod:`.members` (heartbeats,
metrics), the exchange and the checkpoints all build their keys here.
"""

from __future__ import annotations

RUN_JSON = "run.json"
RUN_VERSION = 1
MEMBERS_PREFIX = "members"
ROUNDS_PREFIX = "rounds"
CHECKPOINTS_PREFIX = "checkpoints"
LATEST_CHECKPOINT_KEY = "checkpoints/latest.json"
METRICS_PREFIX = "metrics"
LOGS_PREFIX = "logs"
FINAL_PREFIX = "final"
SLICES_PREFIX = "slices"


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


def ready_prefix(round: int) -> str:
    """``rounds/<round>/ready`` (list it to see who is ready)."""
    return f"{round_prefix(round)}/ready"


def ready_key(round: int, rank: int) -> str:
    """``rounds/<round>/ready/rank-<r>``."""
    return f"{ready_prefix(round)}/{_rank(rank)}"


def abstain_key(round: int, rank: int) -> str:
    """``rounds/<round>/ready/abstain-<r>``: rank r will not contribute to the round (its values were
    not finite). Beside the ready markers, so the one listing that finds who is ready finds it too."""
    _check_index("rank", rank, 6)
    return f"{ready_prefix(round)}/abstain-{rank}"


def quorum_key(round: int) -> str:
    """``rounds/<round>/quorum.json`` (create-only)."""
    return f"{round_prefix(round)}/quorum.json"


def contrib_key(round: int, shard: int, rank: int) -> str:
    """``rounds/<round>/contrib/<shard:04d>/rank-<r>``."""
    return f"{round_prefix(round)}/contrib/{fmt_shard(shard)}/{_rank(rank)}"


def reduced_prefix(round: int) -> str:
    """``rounds/<round>/reduced`` (list it to see which shards are reduced)."""
    return f"{round_prefix(round)}/reduced"


def reduced_key(round: int, shard: int) -> str:
    """``rounds/<round>/reduced/<shard:04d>`` (create-only)."""
    return f"{reduced_prefix(round)}/{fmt_shard(shard)}"


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


def metrics_prefix(rank: int) -> str:
    """``metrics/rank-<r>``."""
    return f"{METRICS_PREFIX}/{_rank(rank)}"


def metrics_key(rank: int, round: int) -> str:
    """``metrics/rank-<r>/<round:08d>.json``."""
    return f"{metrics_prefix(rank)}/{fmt_round(round)}.json"


def log_key(rank: int) -> str:
    """``logs/rank-<r>.log`` (local executor, file stores)."""
    return f"{LOGS_PREFIX}/{_rank(rank)}.log"
