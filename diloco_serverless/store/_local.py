"""Atomic writes on a local (POSIX) file system, for ``file://`` stores and bare paths.

* :func:`atomic_write` writes a temporary file in the target's folder and ``os.replace``s it
  over the target: a reader sees the old bytes or the new bytes, never half a file.
* :func:`atomic_create` writes a finished temporary file and ``os.link``s it to the target.
  ``link(2)`` fails with ``EEXIST`` if the target exists, atomically, so exactly one of many
  concurrent creators wins, and the winner's file is complete the moment it appears.
  On file systems without hard links it falls back to an ``O_EXCL`` claim file + rename.

Temporary files are named ``.diloco-tmp-*`` and are hidden from listings
(:func:`is_temp_name`). A crash can leave one behind; it is never mistaken for an object.
"""

from __future__ import annotations

import errno
import os
import uuid

__all__ = ["TEMP_PREFIX", "NO_HARD_LINKS", "is_temp_name", "atomic_write", "atomic_create"]

TEMP_PREFIX = ".diloco-tmp-"


def is_temp_name(path: str) -> bool:
    """True for the temporary files written by this module."""
    return os.path.basename(path).startswith(TEMP_PREFIX)


def _write_temp(path: str, data: bytes) -> str:
    """Write ``data`` to a fresh temporary file next to ``path``; return its name."""
    folder = os.path.dirname(path) or "."
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f"{TEMP_PREFIX}{uuid.uuid4().hex}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view)
            view = view[written:]
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    os.close(fd)
    return tmp


def atomic_write(path: str, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically (for readers); creates parent folders."""
    tmp = _write_temp(path, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        _unlink_quietly(tmp)
        raise


#: ``link(2)`` errors meaning "this file system has no hard links" (FAT, some FUSE mounts).
NO_HARD_LINKS = frozenset({errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS, errno.EXDEV})


def atomic_create(path: str, data: bytes) -> bool:
    """Create ``path`` with ``data`` only if it does not exist. True if this call created it.

    Uses ``os.link`` of a finished temporary file. Where the file system has no hard links,
    falls back to :func:`_claim_and_rename`.
    """
    if os.path.lexists(path):
        return False
    tmp = _write_temp(path, data)
    try:
        os.link(tmp, path)
        return True
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in NO_HARD_LINKS:
            raise
        return _claim_and_rename(tmp, path)
    finally:
        _unlink_quietly(tmp)


def _claim_and_rename(tmp: str, path: str) -> bool:
    """Fallback create-only without hard links: the ``O_EXCL`` creator of a hidden claim file
    for ``path`` checks that ``path`` is absent and renames its finished temporary file onto
    it; everyone else loses. Readers still never see half a file. A creator killed while
    holding the claim leaves the key uncreatable until ``.diloco-tmp-claim-<name>`` is deleted."""
    folder, name = os.path.split(path)
    claim = os.path.join(folder, f"{TEMP_PREFIX}claim-{name}")
    try:
        os.close(os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    except FileExistsError:
        return False
    try:  # only the claim holder gets here: check-then-rename is exclusive
        if os.path.lexists(path):
            return False
        os.replace(tmp, path)
        return True
    finally:
        _unlink_quietly(claim)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
