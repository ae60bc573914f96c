"""Errors raised by the object-store exchange (codec.py, allreduce.py).

Every message names the key, round or ranks involved and says what to do, so that a replica's
one-line failure in a serverless log is enough to act on.
"""

from __future__ import annotations

from diloco_serverless.errors import ExchangeError


class CorruptObjectError(ExchangeError):
    """An exchange object failed verification (truncated bytes, checksum mismatch, wrong header,
    or written by another run / round / shard). It is never averaged in."""


class MismatchError(ExchangeError):
    """Replicas disagree on what they are averaging (element count, dtype or codec)."""


class RoundPrunedError(ExchangeError):
    """The requested round is gone from the store (pruned) or was skipped by the rest of the run;
    the replica must heal from a checkpoint instead of joining it."""


class AbstainedError(ExchangeError):
    """Too few replicas can contribute to a round because some abstained (their values were not
    finite) and ``min_replicas`` does not allow closing the round without them. Raised identically
    on every replica; the message names the abstaining ranks and their reasons."""


class ParticipantsChangedError(ExchangeError):
    """What decided a round's participants (a replica's own vote, a tombstone, ``quorum.json``) was
    deleted or replaced while the round closed: applying the result could give this replica another
    participant set than the others, so the round fails instead (docs/security.md, "Deletions never
    change a result"). The replica's restart re-runs the round from what the store then holds."""
