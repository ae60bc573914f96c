"""Batches for ``compose_loss``: examples from a source (the stdlib corpus, JSONL) as tensors.

:mod:`.examples` holds the shared :class:`Example` type; :mod:`.stdlib` and :mod:`.jsonl` are the two
sources; :mod:`.builder` turns a source into the batch dict the three loss channels read. To add a
source, see docs/architecture.md, "Adding a data source".
"""

from __future__ import annotations

from diloco_serverless.data.builder import (
    BatchBuilder,
    ExampleSource,
    make_reference_model,
    make_source,
)
from diloco_serverless.data.examples import DataError, Example
from diloco_serverless.data.jsonl import JsonlSource
from diloco_serverless.data.stdlib import StdlibSource

__all__ = [
    "BatchBuilder",
    "DataError",
    "Example",
    "ExampleSource",
    "JsonlSource",
    "StdlibSource",
    "make_reference_model",
    "make_source",
]
