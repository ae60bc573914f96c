"""Fetch the wheel a remote executor shipped, check its SHA-256, write it: a step of an HF Job.

It runs *before* the package is installed (the HF Jobs executor passes this file's text to
``python -c``), so it imports only the standard library and fsspec (with the store's backend,
s3fs or gcsfs, which the Job installed with the package's requirements just before):

    python -c "<this file>" URL SHA256 DEST

The store is read with the Job's storage credentials, found the way the replicas find them
(``AWS_*`` and ``DILOCO_STORAGE_OPTIONS`` for remote stores, ``STORAGE_EMULATOR_HOST`` for a GCS
emulator). The expected SHA-256 comes from the Job's command, written by the launcher, never from
the store: a wheel someone replaced in the bucket is refused before pip sees it.

Exit codes: 0 written to DEST; 2 the object is missing or its SHA-256 differs (a setup error: not
retried); 1 anything else (e.g. the network: the Job's attempts may retry it).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("error: usage: python -c <fetch script> URL SHA256 DEST", file=sys.stderr)
        return 2
    url, expected, dest = argv
    try:
        import fsspec
    except ImportError:
        print("error: cannot fetch the shipped code: fsspec is not installed in the Job's image", file=sys.stderr)
        return 2
    protocol = url.split("://", 1)[0].lower() if "://" in url else "file"
    options: dict[str, object] = {}
    raw = os.environ.get("DILOCO_STORAGE_OPTIONS", "").strip()
    if raw and protocol not in ("file", "memory"):
        try:
            loaded = json.loads(raw)
        except json.JSONDecodeError as exc:
            print(f"error: $DILOCO_STORAGE_OPTIONS is not valid JSON ({exc})", file=sys.stderr)
            return 2
        options = dict(loaded) if isinstance(loaded, dict) else {}
    if protocol in ("gs", "gcs") and os.environ.get("STORAGE_EMULATOR_HOST"):
        options.setdefault("token", "anon")
    try:
        with fsspec.open(url, "rb", **options) as fh:
            data = fh.read()
    except FileNotFoundError:
        print(f"error: the shipped code {url} is not in the store (deleted, or another store?)", file=sys.stderr)
        return 2
    except Exception as exc:  # network, permissions: report, let the platform retry
        print(f"error: could not fetch the shipped code {url}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    got = hashlib.sha256(data).hexdigest()
    if got != expected.strip().lower():
        print(f"error: the shipped code {url} has SHA-256 {got}, not {expected} as recorded at launch; refusing "
              "to install it (was it replaced in the store?)", file=sys.stderr)
        return 2
    os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
    part = f"{dest}.{os.getpid()}.part"
    with open(part, "wb") as out:
        out.write(data)
    os.replace(part, dest)
    print(f"[diloco] fetched {url}: {len(data)} bytes, sha256 {got} (as recorded at launch)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
