"""Token ids of a chat and which of them are the assistant's, exact however the tokenizer merges.

Comparing token ids of a rendered prefix with the whole conversation's fails whenever a merge
crosses a turn boundary: a byte-level BPE merges the template's ``"assistant\\n"`` with an answer
that starts with a space, tab or newline into one token, so the prefix's ids are not a prefix of
the whole's. Text does not merge, so the boundaries are found as text:

1. :func:`render` the conversation up to its last assistant turn once, as text (``full``).
2. :func:`assistant_spans`: assistant turn ``i`` is the characters ``[len(before), len(through))``
   of ``full``, where ``before`` renders the turns before it with the generation prompt and
   ``through`` renders the turns up to it (so the span holds the content and the end-of-turn the
   template writes). Both must be prefixes of ``full`` as text; a template that renders earlier
   turns differently once later ones follow (e.g. one that drops past reasoning) keeps the last
   assistant turn only, and one where even that fails gives None (the row cannot be used).
3. :func:`masked_ids` tokenizes ``full`` once, as ``apply_chat_template(tokenize=True)`` does
   (``add_special_tokens=False``), so the ids are what inference sees, and marks each token whose
   characters overlap a span. A token that straddles a boundary (``"\\n"`` + ``" "``) is marked:
   the model learns to produce it after the generation prompt.

Fast tokenizers give each token's characters (``return_offsets_mapping``). A post-processor that
trims whitespace off offsets (GPT-2's ByteLevel ``trim_offsets``) leaves gaps between tokens; a
gap's characters count for both neighbours, so a whitespace token trimmed to nothing still overlaps
the span it sits on. Tokenizers without offsets (Python / SentencePiece backends) tokenize the
segments between span boundaries separately and concatenate them: the mask is exact, and the ids
at a boundary are those of the two sides tokenized apart (what a generation prompt followed by
the model's answer gives), which may differ from tokenizing the whole text at that one place.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["render", "assistant_spans", "masked_ids"]

Span = tuple[int, int]


def render(tokenizer: Any, messages: Sequence[Mapping[str, str]], generation_prompt: bool) -> str:
    """The chat template's text of ``messages``."""
    out = tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt)
    if not isinstance(out, str):
        raise TypeError(f"apply_chat_template(tokenize=False) returned {type(out).__name__}, not str")
    return out


def assistant_spans(
    tokenizer: Any, messages: Sequence[Mapping[str, str]], assistant: Sequence[int], full: str
) -> list[Span] | None:
    """Character spans ``[a, b)`` of ``full`` (the render of ``messages[: assistant[-1] + 1]``)
    holding each assistant turn ``assistant[k]``; see the module docstring."""
    spans: list[Span] = []
    for i in assistant:
        before = render(tokenizer, messages[:i], True)
        through = full if i == assistant[-1] else render(tokenizer, messages[: i + 1], False)
        stable = full.startswith(before) and full.startswith(through) and len(through) > len(before)
        if not stable or (spans and len(before) < spans[-1][1]):
            break
        spans.append((len(before), len(through)))
    else:
        return spans
    before = render(tokenizer, messages[: assistant[-1]], True)  # the last assistant turn alone
    if full.startswith(before) and len(full) > len(before):
        return [(len(before), len(full))]
    return None


def _overlaps(lo: int, hi: int, spans: Sequence[Span]) -> bool:
    if lo == hi:  # a token of no characters belongs where it stands
        return any(a <= lo < b for a, b in spans)
    return any(lo < b and hi > a for a, b in spans)


def _with_offsets(tokenizer: Any, text: str, spans: Sequence[Span]) -> tuple[list[int], list[int]]:
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    offsets = [(int(s), int(e)) for s, e in enc["offset_mapping"]]
    mask = []
    for k, (s, e) in enumerate(offsets):
        lo = min(s, offsets[k - 1][1]) if k else 0  # a gap before the token counts for it ...
        hi = max(e, offsets[k + 1][0]) if k + 1 < len(offsets) else len(text)  # ... and one after it
        mask.append(int(_overlaps(lo, max(lo, hi), spans)))
    return ids, mask


def _by_segments(tokenizer: Any, text: str, spans: Sequence[Span]) -> tuple[list[int], list[int]]:
    cuts = sorted({0, len(text), *(x for span in spans for x in span)})
    ids: list[int] = []
    mask: list[int] = []
    for a, b in zip(cuts, cuts[1:], strict=False):
        part = list(tokenizer(text[a:b], add_special_tokens=False)["input_ids"])
        on = int(any(s <= a and b <= e for s, e in spans))
        ids += part
        mask += [on] * len(part)
    return ids, mask


def masked_ids(tokenizer: Any, text: str, spans: Sequence[Span]) -> tuple[list[int], list[int]]:
    """(ids of ``text``, 1 for each id on an assistant span else 0); see the module docstring."""
    if getattr(tokenizer, "is_fast", False):
        return _with_offsets(tokenizer, text, spans)
    return _by_segments(tokenizer, text, spans)
