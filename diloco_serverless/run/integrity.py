"""Run integrity: a per-run secret key that never enters the store, and HMACs under it.

Everyone who holds a replica credential can write anything under the bucket prefix. To keep such a
co-tenant from forging or redirecting a run, ``diloco launch`` creates a random key per run and
hands it to the replicas out of band (:data:`RUN_KEY_ENV` in their environment: the local executor's
process environment, a Modal Secret or an HF Jobs secret; the launcher keeps a copy in a private
file, :func:`save_local_key`). ``run.json``, every exchange object and every checkpoint carry an
HMAC-SHA256 under that key; readers that hold the key verify it before trusting a byte and refuse
the object otherwise. A co-tenant can still delete objects (the run then fails clearly), but can
no longer forge them. See docs/security.md for the whole threat model.

A process without the key (a ``diloco status`` on another machine) cannot verify and says so; it
never acts on what it read (executor handles are not commands: see the executors).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from diloco_serverless.config import RUN_KEY_ENV

__all__ = [
    "KEYS_DIR_ENV",
    "MAC_FIELD",
    "RUN_KEY_ENV",
    "load_local_key",
    "load_local_revision",
    "save_local_revision",
    "local_key_path",
    "mac_bytes",
    "mac_json",
    "new_run_key",
    "parse_run_key",
    "place_of",
    "scoped_key",
    "run_key_from_env",
    "save_local_key",
    "verify_bytes",
    "verify_json",
]

#: The field of a signed JSON document that holds its HMAC (hex).
MAC_FIELD = "mac"
_KEY_BYTES = 32
#: Where the launcher keeps the keys of the runs it launched (one file per run, mode 0600).
KEYS_DIR_ENV = "DILOCO_KEYS_DIR"


def new_run_key() -> str:
    """A fresh random run key, as 64 hex characters."""
    return secrets.token_hex(_KEY_BYTES)


def parse_run_key(text: str, *, source: str) -> bytes:
    """The key bytes of a hex run key; ``ValueError`` naming ``source`` if it is not one."""
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        key = b""
    if len(key) != _KEY_BYTES:
        raise ValueError(f"{source} is not a run key ({2 * _KEY_BYTES} hex characters); relaunch or pass the "
                         "key printed by the launcher")
    return key


def run_key_from_env(env: Mapping[str, str] | None = None) -> bytes | None:
    """The run key in ``$DILOCO_RUN_KEY``, or None when it is unset."""
    raw = (os.environ if env is None else env).get(RUN_KEY_ENV, "").strip()
    return parse_run_key(raw, source=f"${RUN_KEY_ENV}") if raw else None


def _keys_dir() -> Path:
    configured = os.environ.get(KEYS_DIR_ENV)
    if configured:
        return Path(configured)
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "diloco-serverless" / "run-keys"


def _key_file(run_url: str) -> Path:
    """One file per run URL (two stores may hold runs with the same id): ``<run_id>-<url hash>``."""
    run_id = run_url.rstrip("/").rsplit("/", 1)[-1]
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in run_id).lstrip(".") or "run"
    digest = hashlib.sha256(run_url.rstrip("/").encode("utf-8")).hexdigest()[:16]
    return _keys_dir() / f"{safe[:64]}-{digest}"


def save_local_key(run_url: str, key_hex: str) -> Path:
    """Keep ``key_hex`` for the run at ``run_url`` in a file only this user can read; returns its path."""
    path = _key_file(run_url)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path.parent, 0o700)  # a folder that existed before (or was made under a loose umask) too
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
    os.fchmod(fd, 0o600)  # O_CREAT's mode applies only to a new file: an existing 0644 one is tightened here
    with os.fdopen(fd, "w") as fh:
        fh.write(key_hex + "\n")
    return path


def load_local_revision(run_url: str) -> int | None:
    """The newest run.json revision this machine wrote for the run at ``run_url`` (kept next to the key
    copy, :func:`save_local_revision`), or None when it wrote none."""
    try:
        text = _key_file(run_url).with_suffix(".revision").read_text("utf-8").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def save_local_revision(run_url: str, revision: int) -> None:
    """Remember that this machine wrote revision ``revision`` of the run's run.json (mode 0600), so an
    older, still validly signed run.json put back in the store is refused (``run/record.py``)."""
    path = _key_file(run_url).with_suffix(".revision")
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(f"{int(revision)}\n")


def local_key_path(run_url: str) -> Path:
    """The file in which this machine keeps the key of the run at ``run_url`` (it may not exist): under
    ``$DILOCO_KEYS_DIR``, else ``$XDG_CONFIG_HOME/diloco-serverless/run-keys`` (``~/.config/...``)."""
    return _key_file(run_url)


def load_local_key(run_url: str) -> bytes | None:
    """The key this machine kept for the run at ``run_url`` (``$DILOCO_RUN_KEY`` wins), or None."""
    from_env = run_key_from_env()
    if from_env is not None:
        return from_env
    path = _key_file(run_url)
    try:
        text = path.read_text("utf-8")
    except OSError:
        return None
    return parse_run_key(text, source=str(path))


#: Rewrites that map every key an object may be read at to the one place its signature binds (see
#: :func:`place_of`): a spread prefix ``x<hh>/<round>/`` is ``rounds/<round>/``, a copy's ``.copy-<c>``
#: suffix goes, and a ready marker's name loses its tag (the tag *is* the marker's MAC).
_PLACE_REWRITES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"^x[0-9a-f]{2}/(\d{8,})/"), r"rounds/\1/"),
    (re.compile(r"\.copy-\d+$"), ""),
    (re.compile(r"(/ready/rank-\d+)\.[0-9a-f]+$"), r"\1"),
)


def place_of(key: str) -> str:
    """The place a signature binds for an object stored at ``key`` (relative to the run, or to the
    scope of a :func:`scoped_key`).

    The key path names everything that says where an object belongs: its round, rank, shard, tree
    level (``partial/l<level>/``), attempt (a start record's time and token), and, through
    :func:`scoped_key`, its slice. The few keys that hold the same object as another key map to that
    key's place: the copies of a quorum or of a reduced shard (``x<hh>/<round>/quorum.json``,
    ``.../reduced/<j>.copy-<c>``), an exchange object under its spread prefix (``x<hh>/``: a run uses one
    form, so no two objects differ only there), and a ready marker named with its tag. A copy of an
    object at any *other* key fails verification.
    """
    if not isinstance(key, str) or not key or "\x00" in key:
        raise ValueError(f"a signed object's place must be its non-empty store key, got {key!r}")
    place = key.strip("/")
    for pattern, repl in _PLACE_REWRITES:
        place = pattern.sub(repl, place)
    return place


def scoped_key(key: bytes, prefix: str) -> bytes:
    """The key that signs the objects under ``prefix`` of a run (a multi-device replica's slice,
    ``slices/<g>``, whose exchange keys are relative to that prefix): an HMAC of the run key and the
    prefix, so an object signed under one prefix never verifies under another. Binding the prefix into
    the key is the same as binding it into every place under it."""
    return hmac.new(key, b"scope\x00" + prefix.strip("/").encode("utf-8"), hashlib.sha256).digest()


def mac_bytes(key: bytes, kind: str, data: bytes, *, place: str) -> str:
    """HMAC-SHA256 (hex) of ``data`` as an object of ``kind`` stored at ``place`` (its store key;
    :func:`place_of` says which keys share a place). Kind and place are bound in, so an object of one
    kind never verifies as another, nor at any key it was not made for (another round, rank, shard,
    slice, tree level or attempt). Every signed object of a run goes through here: a new kind cannot
    forget its place (``place`` is required)."""
    head = kind.encode("utf-8") + b"\x00" + place_of(place).encode("utf-8") + b"\x00"
    return hmac.new(key, head + data, hashlib.sha256).hexdigest()


def verify_bytes(key: bytes, kind: str, data: bytes, tag: object, *, place: str) -> bool:
    """True when ``tag`` is the HMAC of ``data`` as ``kind`` at ``place``, the key the reader read it
    from (constant-time comparison)."""
    return isinstance(tag, str) and hmac.compare_digest(mac_bytes(key, kind, data, place=place), tag)


def _canonical(doc: Mapping[str, Any]) -> bytes:
    body = {k: v for k, v in doc.items() if k != MAC_FIELD}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode("utf-8")


def mac_json(key: bytes, kind: str, doc: Mapping[str, Any], *, place: str) -> dict[str, Any]:
    """``doc`` with its HMAC in :data:`MAC_FIELD` (over the canonical JSON of the other fields, its kind and
    its place: see :func:`mac_bytes`)."""
    return {**{k: v for k, v in doc.items() if k != MAC_FIELD},
            MAC_FIELD: mac_bytes(key, kind, _canonical(doc), place=place)}


def verify_json(key: bytes, kind: str, doc: object, *, place: str) -> bool:
    """True when ``doc`` is a JSON object whose :data:`MAC_FIELD` is its HMAC as ``kind`` at ``place``
    (the key it was read from)."""
    if not isinstance(doc, dict):
        return False
    try:
        body = _canonical(doc)
    except (TypeError, ValueError):
        return False
    return verify_bytes(key, kind, body, doc.get(MAC_FIELD), place=place)
