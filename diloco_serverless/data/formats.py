"""Record formats of user data (``data.format``) and their tokenization into :class:`Example` s.

A row of a datasets source is a dict of columns; ``data.columns`` names the ones each format reads:

============== =============================================== =============================================
format          columns (``?`` = optional)                       example
============== =============================================== =============================================
text            text                                             a document: tokens + EOS, packed (``hf.py``)
chat            messages, hint?                                  prompt = turns before the first assistant turn,
                                                                 loss on the assistant turns only
prompt_response prompt, response, hint?, chosen? + rejected?     the JSONL record of :mod:`.jsonl`
preference      prompt?, chosen, rejected, hint?                 response = chosen; (chosen, rejected) for DPO
============== =============================================== =============================================

A prompt is a string (the user turn) or a list of ``{role, content}`` messages; in ``preference``
``chosen`` / ``rejected`` may be conversations ending with the assistant's answer (the prompt is then
the turns before it when there is no prompt column). :class:`Encoder` tokenizes with the model's chat
template when it has one (the prompt as the user turn(s), the response as the assistant turn);
otherwise prompt tokens then response tokens + EOS. The self-distillation teacher reads the prompt
with ``"\\n\\n" + hint`` appended to its last user turn, cut to ``len(prompt) + data.hint_len``
tokens, and exactly the student's response.

Failure: :class:`DataError` in one line naming the record (``where``), the column and the problem.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from diloco_serverless.config import DataColumns
from diloco_serverless.data.chat_mask import assistant_spans, masked_ids, render
from diloco_serverless.data.examples import DataError, Example, shuffle_lines, split_fraction

__all__ = [
    "FORMATS",
    "Conversation",
    "Prompt",
    "Record",
    "Encoder",
    "detect_format",
    "format_columns",
    "record_from_row",
    "messages_from_row",
    "text_from_row",
    "hint_from_row",
    "row_fraction",
]

FORMATS = ("text", "chat", "prompt_response", "preference")
Conversation = tuple[tuple[str, str], ...]
"""``((role, content), ...)``: hashable messages (the tokenization caches key on them)."""
Prompt = str | Conversation


@dataclass(frozen=True)
class Record:
    """One prompt/response record (formats prompt_response and preference, and JSONL lines)."""

    prompt: Prompt
    response: str
    hint: str | None
    chosen: str | None
    rejected: str | None
    where: str  # "<url>:<line>" or "<source> [split] row <i>"


# ---------------------------------------------------------------------------------- columns
def format_columns(fmt: str, cols: DataColumns) -> tuple[list[str], list[str]]:
    """(required, optional) column names of format ``fmt``."""
    if fmt == "text":
        return [cols.text], []
    if fmt == "chat":
        return [cols.messages], [cols.hint]
    if fmt == "prompt_response":
        return [cols.prompt, cols.response], [cols.hint, cols.chosen, cols.rejected]
    if fmt == "preference":
        return [cols.chosen, cols.rejected], [cols.prompt, cols.hint]
    raise DataError(f"data.format must be one of {', '.join(FORMATS)} or auto, got {fmt!r}")


def detect_format(columns: Sequence[str], cols: DataColumns, what: str) -> str:
    """``data.format = "auto"``: preference (chosen + rejected), chat (messages), prompt_response
    (prompt + response) or text, by the columns present; DataError naming them otherwise."""
    have = set(columns)
    if {cols.chosen, cols.rejected} <= have:
        return "preference"
    if cols.messages in have:
        return "chat"
    if {cols.prompt, cols.response} <= have:
        return "prompt_response"
    if cols.text in have:
        return "text"
    raise DataError(
        f"{what} has columns {sorted(have)}, none of a known format; set data.format (text, chat, prompt_response, "
        "preference) and name its columns with data.columns.<field> = \"<column>\""
    )


def row_fraction(row: Mapping[str, Any], columns: Sequence[str]) -> float:
    """A stable number in [0, 1) from the record's content in ``columns`` (the held-out split):
    independent of where the record sits, so duplicates fall on the same side."""
    key = json.dumps([row.get(c) for c in columns], ensure_ascii=False, sort_keys=True, default=str)
    return split_fraction(key)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _string(row: Mapping[str, Any], col: str, where: str, *, required: bool) -> str | None:
    value = row.get(col)
    if value is None:
        if required:
            raise DataError(f"{where}: column {col!r} is missing or null; every record needs it")
        return None
    if not isinstance(value, str):
        raise DataError(f"{where}: column {col!r} must be a string, got {type(value).__name__} {_show(value)}")
    if required and not value.strip():
        raise DataError(f"{where}: column {col!r} is an empty string")
    return value


def _turns(value: Any, col: str, where: str) -> Conversation:
    if not isinstance(value, (list, tuple)) or not value:
        raise DataError(
            f"{where}: column {col!r} must be a non-empty list of {{role, content}} messages, "
            f"got {type(value).__name__} {_show(value)}"
        )
    out = []
    for i, msg in enumerate(value):
        role = msg.get("role") if isinstance(msg, Mapping) else None
        content = msg.get("content") if isinstance(msg, Mapping) else None
        if not isinstance(role, str) or not role or not isinstance(content, str):
            raise DataError(
                f"{where}: column {col!r} message {i} must be {{role: str, content: str}}, got {_show(msg)}"
            )
        out.append((role, content))
    return tuple(out)


def _prompt(row: Mapping[str, Any], col: str, where: str, *, required: bool) -> Prompt | None:
    value = row.get(col)
    if isinstance(value, (list, tuple)):
        return _turns(value, col, where)
    return _string(row, col, where, required=required)


def _answer(row: Mapping[str, Any], col: str, where: str) -> tuple[str, Conversation]:
    """A required response: a string, or a conversation whose last turn is the assistant's answer
    (returns that answer and the turns before it)."""
    value = row.get(col)
    if isinstance(value, (list, tuple)):
        turns = _turns(value, col, where)
        role, content = turns[-1]
        if role != "assistant" or not content.strip():
            raise DataError(f"{where}: column {col!r} is a conversation that does not end with an assistant turn")
        return content, turns[:-1]
    text = _string(row, col, where, required=True)
    assert text is not None
    return text, ()


def hint_from_row(row: Mapping[str, Any], cols: DataColumns, where: str) -> str | None:
    """The optional hint (None when absent, null or empty)."""
    return _string(row, cols.hint, where, required=False) or None


def record_from_row(row: Mapping[str, Any], fmt: str, cols: DataColumns, where: str) -> Record:
    """A Record of format ``prompt_response`` or ``preference``; DataError naming column and record."""
    hint = hint_from_row(row, cols, where)
    if fmt == "preference":
        chosen, prefix = _answer(row, cols.chosen, where)
        rejected, _ = _answer(row, cols.rejected, where)
        prompt = _prompt(row, cols.prompt, where, required=False) or prefix or None
        if prompt is None:
            raise DataError(
                f"{where}: no prompt: column {cols.prompt!r} is missing or empty and {cols.chosen!r} is not a "
                "conversation to take it from"
            )
        return Record(prompt, chosen, hint, chosen, rejected, where)
    prompt = _prompt(row, cols.prompt, where, required=True)
    response = _string(row, cols.response, where, required=True)
    assert prompt is not None and response is not None
    pair = [row.get(cols.chosen) is not None, row.get(cols.rejected) is not None]
    if pair[0] != pair[1]:
        have, lack = (cols.chosen, cols.rejected) if pair[0] else (cols.rejected, cols.chosen)
        raise DataError(f"{where}: column {have!r} is set but {lack!r} is not; give both or neither")
    if not pair[0]:
        return Record(prompt, response, hint, None, None, where)
    chosen, rejected = _answer(row, cols.chosen, where)[0], _answer(row, cols.rejected, where)[0]
    return Record(prompt, response, hint, chosen, rejected, where)


def messages_from_row(row: Mapping[str, Any], cols: DataColumns, where: str) -> Conversation:
    """The chat of a ``chat`` record: valid messages, an assistant turn with content, and a turn before it."""
    turns = _turns(row.get(cols.messages), cols.messages, where)
    roles = [role for role, _ in turns]
    if "assistant" not in roles:
        raise DataError(f"{where}: column {cols.messages!r} has no assistant turn (roles {roles}); nothing to learn")
    if roles.index("assistant") == 0:
        raise DataError(f"{where}: column {cols.messages!r} starts with an assistant turn; it needs a prompt before it")
    if not any(content.strip() for role, content in turns if role == "assistant"):
        raise DataError(f"{where}: column {cols.messages!r} has only empty assistant turns")
    return turns


def text_from_row(row: Mapping[str, Any], cols: DataColumns, where: str) -> str:
    """The document of a ``text`` record ("" for an empty one, which contributes nothing)."""
    value = row.get(cols.text)
    if value is None:
        raise DataError(f"{where}: column {cols.text!r} is missing or null; every record needs it")
    if not isinstance(value, str):
        raise DataError(f"{where}: column {cols.text!r} must be a string, got {type(value).__name__} {_show(value)}")
    return value


# ---------------------------------------------------------------------------------- tokenization
def _as_messages(prompt: Prompt) -> list[dict[str, str]]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [{"role": role, "content": content} for role, content in prompt]


def with_hint(prompt: Prompt, hint: str) -> Prompt:
    """The teacher's prompt: ``"\\n\\n" + hint`` appended to the last user turn (the last turn if none)."""
    if isinstance(prompt, str):
        return f"{prompt}\n\n{hint}"
    turns = list(prompt)
    users = [i for i, (role, _) in enumerate(turns) if role == "user"]
    i = users[-1] if users else len(turns) - 1
    turns[i] = (turns[i][0], f"{turns[i][1]}\n\n{hint}")
    return tuple(turns)


class Encoder:
    """Token ids of records for one tokenizer. Caches are keyed on the strings (records come back
    every epoch); returned lists are fresh copies, so consumers may keep them."""

    def __init__(self, tokenizer: Any, hint_len: int) -> None:
        self.tokenizer = tokenizer
        self.hint_len = hint_len
        self.eos: int | None = tokenizer.eos_token_id
        self.bos: int | None = getattr(tokenizer, "bos_token_id", None)
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
        self._pair = functools.lru_cache(maxsize=8192)(self._tokenize_pair)
        self._chat = functools.lru_cache(maxsize=4096)(self._tokenize_chat)

    # ------------------------------------------------------------ primitives
    def ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def chat_ids(self, messages: Sequence[Mapping[str, str]], generation_prompt: bool) -> list[int]:
        out = self.tokenizer.apply_chat_template(
            list(messages), tokenize=True, add_generation_prompt=generation_prompt
        )
        if isinstance(out, dict) or hasattr(out, "keys"):
            out = out["input_ids"]
        return list(out)

    def document(self, text: str) -> list[int]:
        """A ``text`` document: its tokens (with the tokenizer's own specials, e.g. BOS) + EOS."""
        if not text:
            return []
        ids = list(self.tokenizer(text, add_special_tokens=True, verbose=False)["input_ids"])
        if self.eos is not None and (not ids or ids[-1] != self.eos):
            ids.append(self.eos)
        return ids

    def pair(self, prompt: Prompt, response: str) -> tuple[list[int], list[int]]:
        """(prompt ids, response ids), with the chat template when the tokenizer has one."""
        p, r = self._pair(prompt, response)
        return list(p), list(r)

    def _tokenize_pair(self, prompt: Prompt, response: str) -> tuple[list[int], list[int]]:
        eos = [self.eos] if self.eos is not None else []
        if self.has_template:
            user = _as_messages(prompt)
            p = self.chat_ids(user, True)
            full = self.chat_ids(user + [{"role": "assistant", "content": response}], False)
            if full[: len(p)] == p and len(full) > len(p):
                return p, full[len(p) :]
            # a merge across the boundary (the template's newline + the answer's leading whitespace):
            # the answer and its end-of-turn as text, tokenized after the prompt, as generation makes them
            p_text = render(self.tokenizer, user, True)
            f_text = render(self.tokenizer, user + [{"role": "assistant", "content": response}], False)
            if f_text.startswith(p_text) and len(f_text) > len(p_text):
                return p, self.ids(f_text[len(p_text) :])
            return p, self.ids(response) + eos
        text = prompt if isinstance(prompt, str) else "\n\n".join(content for _, content in prompt)
        start = [self.bos] if self.bos is not None else []
        return start + self.ids(text), self.ids(response) + eos

    # ------------------------------------------------------------ prompt / response records
    @staticmethod
    def rejected_text(rec: Record, rng: Any) -> str:
        """The record's rejected answer, or its response with lines (one line: words) shuffled."""
        if rec.rejected is not None:
            return rec.rejected
        parts = rec.response.splitlines(keepends=True)
        if len(parts) < 2:
            parts = re.findall(r"\S+\s*", rec.response)
        shuffled = shuffle_lines([[i] for i in range(len(parts))], rng) if len(parts) >= 2 else None
        if shuffled is None or [parts[i] for i in shuffled] == parts:
            return rec.response[::-1]  # one token-ish unit: reversing still makes a worse sequence
        return "".join(parts[i] for i in shuffled)

    def prompt_response(self, rec: Record, rng: Any) -> Example:
        """All three channels of a record: student (prompt + response), teacher (prompt with the hint
        + the same response), pair (chosen or response, rejected or the response shuffled). DataError
        naming the record for one the chat template cannot render: the caller skips and counts it."""
        try:
            return self._prompt_response(rec, rng)
        except DataError:
            raise
        except Exception as exc:  # a template's own raise_exception, jinja errors
            why = " ".join(str(exc).split())
            raise DataError(f"{rec.where}: the chat template cannot render this record: {why}") from exc

    def _prompt_response(self, rec: Record, rng: Any) -> Example:
        prompt, response = self.pair(rec.prompt, rec.response)
        if rec.hint:
            teacher, t_resp = self.pair(with_hint(rec.prompt, rec.hint), rec.response)
            teacher = teacher[-(len(prompt) + self.hint_len) :] if t_resp == response else prompt
        else:
            teacher = prompt
        chosen = self.pair(rec.prompt, rec.chosen)[1] if rec.chosen is not None else []
        rejected = self.pair(rec.prompt, self.rejected_text(rec, rng))[1]
        return Example(prompt, response, teacher, rejected, chosen, rec.where)

    # ------------------------------------------------------------ chats
    def chat(self, turns: Conversation, hint: str | None, where: str) -> Example:
        """A ``chat`` record (validated by :func:`messages_from_row`): prompt = the tokens before the
        first assistant turn, response = the rest up to the end of the last assistant turn, with a
        loss mask on the assistant turns, found as character spans of the rendered text
        (:mod:`.chat_mask`), so merges across a turn boundary cannot fail a row. A template that
        renders earlier turns differently once later ones follow (e.g. one that drops past reasoning)
        keeps the last assistant turn only. DataError for a row the template cannot render (it
        raises, or renders no assistant text): the caller skips and counts it."""
        if not self.has_template:
            raise DataError(f"{where}: data.format='chat' needs a tokenizer with a chat template; this one has none")
        try:
            out = self._chat(turns, hint)
        except DataError:
            raise
        except Exception as exc:  # a template's own raise_exception (e.g. roles must alternate), jinja errors
            raise DataError(f"{where}: the chat template cannot render this conversation: {exc}") from exc
        if out is None:
            raise DataError(
                f"{where}: the chat template renders no assistant text for this conversation (the render of the "
                "turns before the last assistant turn is not a prefix of the whole, or the turn renders empty)"
            )
        prompt, response, teacher, mask = out
        return Example(list(prompt), list(response), list(teacher), [], [], where, list(mask))

    def _masked(self, msgs: list[dict[str, str]], assistant: list[int]) -> tuple[list[int], list[int]] | None:
        """(ids of the chat up to its last assistant turn, assistant mask), or None."""
        full = render(self.tokenizer, msgs[: assistant[-1] + 1], False)
        spans = assistant_spans(self.tokenizer, msgs, assistant, full)
        if spans is None:
            return None
        return masked_ids(self.tokenizer, full, spans)

    def _tokenize_chat(
        self, turns: Conversation, hint: str | None
    ) -> tuple[list[int], list[int], list[int], list[int]] | None:
        assistant = [i for i, (role, content) in enumerate(turns) if role == "assistant"]
        msgs = _as_messages(turns)
        out = self._masked(msgs, assistant)
        marked = [k for k, on in enumerate(out[1]) if on] if out is not None else []
        if out is None or not marked or marked[0] == 0:
            return None
        ids, on = out
        start, end = marked[0], marked[-1] + 1
        prompt, response, mask = ids[:start], ids[start:end], on[start:end]
        teacher = prompt
        if hint:
            t_msgs = _as_messages(with_hint(turns[: assistant[0]], hint)) + msgs[assistant[0] :]
            t_out = self._masked(t_msgs, assistant)
            t_start = next((k for k, m in enumerate(t_out[1]) if m), None) if t_out is not None else None
            if t_out is not None and t_start and t_out[0][t_start : t_start + len(response)] == response:
                teacher = t_out[0][:t_start][-(len(prompt) + self.hint_len) :]
        return prompt, response, teacher, mask
