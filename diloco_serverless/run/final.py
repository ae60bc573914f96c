"""``final/DONE.json``: the signed list of the final model's files, the only proof that ``final/`` is complete.

The replica that writes the final model (``trainer/checkpoint.py``, ``write_final``) uploads every file,
then writes ``final/DONE.json``: each file's key and SHA-256, signed with the run key and bound to its
place (:mod:`.integrity`). Everything that acts on a finished run reads it through :func:`read_done`:

* a starting replica exits as "already finished" only with a valid one;
* ``write_final`` replaces an invalid one (its writer holds the final lock) instead of skipping the model;
* ``Run.status``/``Run.wait`` count a run's final model as written only with a valid one;
* ``diloco push`` uploads exactly the files it lists, each checked against its SHA-256
  (``launcher/hub.py``), and nothing else under ``final/``.

A planted or edited ``DONE.json`` (no signature, another run's, a file list changed) is
:class:`InvalidFinal`; without the run key (a run created by hand) nothing can be verified and the
record is only checked for shape.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from diloco_serverless.errors import RunError
from diloco_serverless.run.integrity import mac_json, verify_json
from diloco_serverless.run.layout import FINAL_PREFIX
from diloco_serverless.store.errors import ObjectNotFound, ObjectTooLarge
from diloco_serverless.store.objectstore import ObjectStore

__all__ = ["DONE_KIND", "FINAL_DONE", "InvalidFinal", "done_bytes", "read_done"]

FINAL_DONE = f"{FINAL_PREFIX}/DONE.json"
#: What DONE.json's HMAC is bound to (with its place, ``final/DONE.json``).
DONE_KIND = "final-done"
#: Largest DONE.json read (a file list of a model: a few KiB).
MAX_DONE_BYTES = 1 << 20
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class InvalidFinal(RunError):
    """``final/DONE.json`` exists but is not a valid, signed record of the final model's files."""


def done_bytes(run_key: bytes | None, files: Mapping[str, str], **extra: Any) -> bytes:
    """The bytes of ``final/DONE.json`` for ``files`` (key under ``final/`` -> SHA-256 hex), with the run's
    HMAC when there is a key; ``extra`` (writer, attempt, time) is signed too."""
    doc = {**extra, "files": dict(sorted(files.items()))}
    return json.dumps(mac_json(run_key, DONE_KIND, doc, place=FINAL_DONE) if run_key is not None else doc).encode()


def read_done(store: ObjectStore, run_key: bytes | None) -> dict[str, str] | None:
    """The final model's files (key -> SHA-256) from ``final/DONE.json`` of the run at ``store``; ``None``
    when it does not exist. :class:`InvalidFinal` naming it when it is too large, not JSON, lists no
    files under ``final/`` with a SHA-256 each, or (with ``run_key``) lacks this run's signature for
    its place."""
    where = f"{store.url}/{FINAL_DONE}"
    try:
        raw = store.get(FINAL_DONE, max_bytes=MAX_DONE_BYTES)
    except ObjectNotFound:
        return None
    except ObjectTooLarge as e:
        raise InvalidFinal(f"{where} is larger than {MAX_DONE_BYTES} bytes; refusing it ({e})") from e
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise InvalidFinal(f"{where} is not JSON ({e}); the final model is not complete") from e
    if run_key is not None and not verify_json(run_key, DONE_KIND, doc, place=FINAL_DONE):
        raise InvalidFinal(
            f"{where} does not carry this run's signature (planted, or copied from another run): the final "
            "model is not known to be complete, so nothing acts on it. Check who can write the bucket prefix "
            "(docs/security.md)"
        )
    files = doc.get("files") if isinstance(doc, dict) else None
    if (not isinstance(files, dict) or not files
            or not all(isinstance(k, str) and k.startswith(FINAL_PREFIX + "/") and k != FINAL_DONE
                       and isinstance(v, str) and _SHA256.match(v) for k, v in files.items())):
        raise InvalidFinal(f"{where} does not list the final model's files (key under {FINAL_PREFIX}/ -> "
                           "SHA-256); the final model is not complete")
    return dict(files)
