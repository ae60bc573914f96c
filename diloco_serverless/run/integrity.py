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
    "local_key_path",
    "mac_bytes",
    "mac_json",
    "new_run_key",
    "parse_run_key",
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
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(key_hex + "\n")
    return path


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


def mac_bytes(key: bytes, kind: str, data: bytes) -> str:
    """HMAC-SHA256 (hex) of ``data`` as an object of ``kind`` (the kind is bound in, so an object of
    one kind never verifies as another)."""
    return hmac.new(key, kind.encode("utf-8") + b"\x00" + data, hashlib.sha256).hexdigest()


def verify_bytes(key: bytes, kind: str, data: bytes, tag: object) -> bool:
    """True when ``tag`` is the HMAC of ``data`` as ``kind`` (constant-time comparison)."""
    return isinstance(tag, str) and hmac.compare_digest(mac_bytes(key, kind, data), tag)


def _canonical(doc: Mapping[str, Any]) -> bytes:
    body = {k: v for k, v in doc.items() if k != MAC_FIELD}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode("utf-8")


def mac_json(key: bytes, kind: str, doc: Mapping[str, Any]) -> dict[str, Any]:
    """``doc`` with its HMAC in :data:`MAC_FIELD` (over the canonical JSON of the other fields)."""
    return {**{k: v for k, v in doc.items() if k != MAC_FIELD}, MAC_FIELD: mac_bytes(key, kind, _canonical(doc))}


def verify_json(key: bytes, kind: str, doc: object) -> bool:
    """True when ``doc`` is a JSON object whose :data:`MAC_FIELD` is its HMAC as ``kind``."""
    if not isinstance(doc, dict):
        return False
    try:
        body = _canonical(doc)
    except (TypeError, ValueError):
        return False
    return verify_bytes(key, kind, body, doc.get(MAC_FIELD))
