"""Writing pairs, hints and call records: parquet (with pyarrow, the ``data`` extra) or JSONL.

The pairs file is what ``data.format = "preference"`` reads (columns ``prompt``, ``chosen``,
``rejected``, ``hint``; ``data.format = "auto"`` detects it); the hints file is a
``prompt_response`` dataset with a ``hint`` column. Both keep ``state_id`` and the chat shape of each
side (``chosen_messages`` / ``rejected_messages``), which the trainer does not read.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from diloco_serverless.replay.errors import ReplayInputError

__all__ = ["write_rows", "read_rows"]

SUFFIXES = (".parquet", ".jsonl")


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401
    except ImportError as exc:
        raise ReplayInputError(f"writing parquet needs pyarrow ({exc.msg}); pip install 'diloco-serverless[data]', "
                               "or write .jsonl") from None
    return pyarrow


def _check_suffix(path: Path) -> None:
    if path.suffix not in SUFFIXES:
        raise ReplayInputError(f"{path}: the output must end with .parquet or .jsonl, got {path.suffix or 'none'!r}")


def write_rows(path: str | Path, rows: Sequence[Mapping[str, Any]]) -> Path:
    """Write ``rows`` to ``path`` (.parquet or .jsonl), replacing it atomically."""
    p = Path(path)
    _check_suffix(p)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f".{p.name}.tmp")
    if p.suffix == ".jsonl":
        tmp.write_text("".join(json.dumps(dict(r), ensure_ascii=False) + "\n" for r in rows), "utf-8")
    else:
        pa = _pyarrow()
        if not rows:
            raise ReplayInputError(f"{p}: no records to write (an empty parquet file has no columns); "
                                   "see the reasons table")
        pa.parquet.write_table(pa.Table.from_pylist([dict(r) for r in rows]), tmp)
    tmp.replace(p)
    return p


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a file :func:`write_rows` wrote."""
    p = Path(path)
    _check_suffix(p)
    if p.suffix == ".jsonl":
        return [json.loads(line) for line in p.read_text("utf-8").splitlines() if line.strip()]
    return list(_pyarrow().parquet.read_table(p).to_pylist())
