"""Batches for ``compose_loss``: examples from a source (the stdlib corpus, JSONL, 🤗 datasets) as tensors.

:mod:`.examples` holds the shared :class:`Example` type; :mod:`.stdlib`, :mod:`.jsonl` and :mod:`.hf`
are the sources (:mod:`.formats` turns records of each ``data.format`` into examples);
:mod:`.builder` turns a source into the batch dict the three loss channels read, with
:mod:`.prefetch`'s background thread. To add a source, see docs/architecture.md, "Where to add
things"; user-facing reference: docs/data.md.
"""

from __future__ import annotations

from diloco_serverless.data.builder import (
    BatchBuilder,
    ExampleSource,
    StreamSource,
    check_channels,
    make_reference_model,
    make_source,
)
from diloco_serverless.data.examples import DataError, Example
from diloco_serverless.data.hf import DatasetsSource
from diloco_serverless.data.jsonl import JsonlSource
from diloco_serverless.data.prompts import PromptBatcher, PromptRecord, PromptSource
from diloco_serverless.data.stdlib import StdlibSource

__all__ = [
    "BatchBuilder",
    "DataError",
    "DatasetsSource",
    "Example",
    "ExampleSource",
    "JsonlSource",
    "PromptBatcher",
    "PromptRecord",
    "PromptSource",
    "StdlibSource",
    "StreamSource",
    "check_channels",
    "make_reference_model",
    "make_source",
]
