"""The documents tell the truth about the code: every command, option, config key, module and file
they name exists.

Read from README.md, docs/*.md, infra/**/README.md and examples/* (fenced shell blocks, console
prompts, inline code that starts with ``diloco``, and ``# ...`` comment lines of TOML that show a
command):

- each ``diloco`` command's subcommand and options exist in the typer app as it is registered now
  (introspected through click, so commands added later are checked the same way), with no more
  positional arguments than the command takes;
- each ``--set key=value`` validates against :class:`RunConfig` (except in a console example whose
  output is the ``error:`` it demonstrates);
- each ``python -m module``, ``from diloco_serverless... import ...`` and dotted
  ``diloco_serverless.x.y`` name imports (or is an attribute of a module that does);
- each repository path (``diloco_serverless/...``, ``tests/...``, ``benchmarks/...``, ``docs/...``,
  ``examples/...``, ``infra/...``) and relative Markdown link exists, and each section a document,
  docstring or message points at (``docs/x.md#anchor``, ``docs/x.md, "Section"``) is a heading
  there. The package's and tests' own source is scanned for paths and sections too: docstrings and
  error messages are documentation.
"""

from __future__ import annotations

import importlib
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import typer

from diloco_serverless.cli import app
from diloco_serverless.config import RunConfig
from support import REPO_ROOT

SHELL_LANGS = {"bash", "sh", "shell", "console", "zsh"}
OPERATORS = {"&&", "||", "|", ";", ">", ">>", "<", "2>", "&"}
PATH_RE = re.compile(r"(?<![\w./-])((?:diloco_serverless|tests|benchmarks|docs|examples|infra)/[\w./*-]*\w)")
MODULE_RE = re.compile(r"(?<![\w/.])(diloco_serverless(?:\.[A-Za-z_]\w*)+)")
FROM_IMPORT_RE = re.compile(r"from (diloco_serverless[\w.]*) import ([\w, ()]+)")
PY_M_RE = re.compile(r"python3? -m ([\w.]+)")
SECTION_RE = re.compile(r"(docs/\w+\.md)(?:#([\w-]+)|,? \(?\"([^\"]+)\")")


def doc_files() -> list[Path]:
    files = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
    files += sorted((REPO_ROOT / "infra").rglob("README.md"))
    files += sorted(p for p in (REPO_ROOT / "examples").iterdir() if p.is_file())
    return files


def source_files() -> list[Path]:
    """Code whose docstrings and messages name files and sections."""
    roots = [REPO_ROOT / "diloco_serverless", REPO_ROOT / "tests", REPO_ROOT / "benchmarks"]
    return sorted(p for root in roots for p in root.rglob("*.py") if "results" not in p.parts)


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO_ROOT))


# ------------------------------------------------------------------------------ extraction
@dataclass(frozen=True)
class Command:
    argv: tuple[str, ...]
    where: str
    shows_error: bool = False  # a console example whose output is the error it demonstrates


def _blocks(text: str) -> Iterator[tuple[str, str, int]]:
    """(language, body, line number) of each fenced block."""
    for m in re.finditer(r"^```([\w-]*)[^\n]*\n(.*?)^```", text, flags=re.S | re.M):
        yield m.group(1).lower(), m.group(2), text[: m.start()].count("\n") + 1


def _logical_lines(body: str) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    pending, start = "", 0
    for i, line in enumerate(body.splitlines()):
        if not pending:
            start = i
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append((start, pending + line))
        pending = ""
    if pending:
        out.append((start, pending))
    return out


def _split(line: str) -> list[list[str]]:
    """Simple commands of a shell line (split at ``&&``, ``|``, ``;``, redirections; comments dropped)."""
    lex = shlex.shlex(line, posix=True, punctuation_chars=";&|<>")
    lex.whitespace_split = True
    lex.commenters = "#"
    try:
        tokens = list(lex)
    except ValueError:  # unbalanced quotes: not a command we can read
        return []
    parts: list[list[str]] = [[]]
    skip_next = False
    for tok in tokens:
        if skip_next:
            skip_next = False
            continue
        if tok in OPERATORS or set(tok) <= set(";&|<>"):
            skip_next = tok.startswith((">", "<"))  # the redirection's file
            parts.append([])
        else:
            parts[-1].append(tok)
    return [p for p in parts if p]


def _diloco(tokens: list[str]) -> list[str] | None:
    """The ``diloco ...`` command in ``tokens`` (after ``VAR=x`` assignments, ``time`` and the like)."""
    for i, tok in enumerate(tokens):
        if tok == "diloco":
            return tokens[i:]
        if "=" in tok or tok in {"time", "nohup", "env", "sudo", "uv", "run", "pipx"}:
            continue
        return None
    return None


def _inline(text: str, where: str) -> list[Command]:
    """Inline code that is a command: ```diloco <command> ...``` (not prose like ```diloco status / logs```)."""
    out = []
    for m in re.finditer(r"`(diloco [^`]+)`", text):
        for tokens in _split(m.group(1)):
            argv = _diloco(tokens)
            if argv and len(argv) > 1 and re.fullmatch(r"[a-z][a-z-]*|-.*", argv[1]) and "/" not in argv:
                out.append(Command(tuple(argv), f"{where}:{text[: m.start()].count(chr(10)) + 1} (inline)"))
    return out


def _toml_comments(text: str, where: str, line0: int = 1) -> list[Command]:
    """Commands shown in ``#`` comments of TOML: a comment that is a command (``#   diloco ...``,
    ``#   Modal:   diloco ...``, continued with ``\\``), and inline code in comments."""
    out: list[Command] = []
    lines = text.splitlines()
    n = 0
    while n < len(lines):
        start, comment = n, lines[n].split("#", 1)[1].strip() if "#" in lines[n] else ""
        while comment.endswith("\\") and n + 1 < len(lines) and "#" in lines[n + 1]:
            n += 1
            comment = comment[:-1] + " " + lines[n].split("#", 1)[1].strip()
        n += 1
        m = re.match(r"(?:[\w ]+:\s+)?(diloco .*)", comment)
        if m:
            for tokens in _split(m.group(1)):
                if (argv := _diloco(tokens)) is not None:
                    out.append(Command(tuple(argv), f"{where}:{line0 + start}"))
        out += [Command(c.argv, f"{where}:{line0 + start} (inline)") for c in _inline(comment, where)]
    return out


def commands_in(path: Path) -> list[Command]:
    text = path.read_text()
    if path.suffix == ".toml":
        return _toml_comments(text, _rel(path))
    out: list[Command] = []
    fenced = []
    for lang, body, line0 in _blocks(text):
        fenced.append(body)
        if lang == "toml":
            out += _toml_comments(body, _rel(path), line0 + 1)
            continue
        if lang not in SHELL_LANGS:
            continue
        lines = body.splitlines()
        for start, line in _logical_lines(body):
            if lang == "console":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            nxt = lines[start + 1].strip() if start + 1 < len(lines) else ""
            for tokens in _split(line):
                if (argv := _diloco(tokens)) is not None:
                    out.append(Command(tuple(argv), f"{_rel(path)}:{line0 + start + 1}", nxt.startswith("error:")))
    prose = text
    for body in fenced:
        prose = prose.replace(body, "\n" * body.count("\n"))
    return out + _inline(prose, _rel(path))


def all_commands() -> list[Command]:
    return [c for path in doc_files() for c in commands_in(path)]


# ------------------------------------------------------------------------------ the CLI as click sees it
@cache
def cli() -> Any:
    """The app as click sees it (typer's own click: read by duck typing, not by click's classes)."""
    group: Any = typer.main.get_command(app)
    assert _is_group(group) and group.commands
    return group


def _is_group(cmd: Any) -> bool:
    return isinstance(getattr(cmd, "commands", None), dict)


def _options(cmd: Any) -> dict[str, Any]:
    return {opt: p for p in cmd.params for opt in (*p.opts, *p.secondary_opts) if opt.startswith("-")}


def _takes_value(param: Any) -> bool:
    return not (getattr(param, "is_flag", False) or getattr(param, "count", False))


def _parse(command: Command) -> tuple[list[str], list[tuple[str, str | None]]]:
    """Problems of a ``diloco`` command line, and its (option, value) pairs."""
    problems: list[str] = []
    pairs: list[tuple[str, str | None]] = []
    argv = [a.strip("[]") for a in command.argv[1:] if a.strip("[]") and a not in {"...", "…"}]
    cmd = cli()
    name = "diloco"
    positionals = 0
    i = 0
    while i < len(argv):
        tok = argv[i]
        i += 1
        if tok.startswith("-") and len(tok) > 1 and not re.fullmatch(r"-\d[\d.e-]*", tok):
            opt, _, inline = tok.partition("=")
            param = _options(cmd).get(opt)
            if param is None and opt != "--help":
                problems.append(f"`{name}` has no option {opt} (it has {', '.join(sorted(_options(cmd)))})")
                continue
            value = inline or None
            if param is not None and _takes_value(param) and not inline and i < len(argv):
                value, i = argv[i], i + 1
            pairs.append((opt, value))
            continue
        if _is_group(cmd):
            sub = cmd.commands.get(tok)
            if sub is None:
                problems.append(f"`{name}` has no command {tok!r} (it has {', '.join(sorted(cmd.commands))})")
                return problems, pairs
            cmd, name = sub, f"{name} {tok}"
            continue
        positionals += 1
    if cmd is cli() and not pairs:
        problems.append("`diloco` without a command")
    arguments = [p for p in cmd.params if p.param_type_name == "argument"]
    if not _is_group(cmd) and all(a.nargs != -1 for a in arguments):
        takes = sum(a.nargs for a in arguments)
        if positionals > takes:
            problems.append(f"`{name}` takes {takes} argument(s), the doc gives {positionals}")
    return problems, pairs


def _set_problem(value: str | None) -> str | None:
    if value is None or "=" not in value:
        return f"--set needs key=value, got {value!r}"
    try:
        RunConfig.load(None, [value])
    except Exception as exc:  # the message is what the user would see
        return f"--set {value}: {str(exc).splitlines()[0]}"
    return None


def _secret_problem(command: Command, pairs: list[tuple[str, str | None]]) -> str | None:
    """How each executor takes storage credentials: HF Jobs forwards environment variables (``--secret``
    names one), Modal containers get only the Modal Secrets named (a bucket without one is refused)."""
    opts: dict[str, list[str | None]] = {}
    for opt, value in pairs:
        opts.setdefault(opt, []).append(value)
    executor = (opts.get("--executor") or [None])[-1]
    secrets = [v or "" for v in opts.get("--secret", [])]
    if executor == "hf-jobs":
        bad = [v for v in secrets if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", v)]
        if bad:
            return f"hf-jobs --secret names an environment variable to forward; {bad} is not one"
    if executor == "modal" and not secrets and not any(
        (v or "").startswith(("deployed_app=", "app=")) for v in opts.get("-x", []) + opts.get("--executor-opt", [])
    ):
        stores = [v or "" for v in opts.get("--store", [])]
        for config in opts.get("--config", []):
            if config and (REPO_ROOT / config).is_file():
                stores.append(RunConfig.from_toml(REPO_ROOT / config).store)
        if "--store-from-terraform" in opts or any(st.startswith(("s3://", "gs://")) for st in stores):
            return "a modal launch with a bucket and no --secret is refused (Modal containers get no exported AWS_*)"
    return None


# ------------------------------------------------------------------------------ modules and files
def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for k in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:k]))
        except ImportError:
            continue
        for attr in parts[k:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def _headings(doc: Path) -> tuple[set[str], set[str]]:
    """(heading texts, GitHub anchors) of a Markdown file."""
    texts, anchors = set(), set()
    for line in doc.read_text().splitlines():
        if m := re.match(r"#{1,6} (.+)", line):
            title = m.group(1).strip()
            texts.add(title)
            texts.add(title.replace("`", ""))
            anchors.add(re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", title.lower())))
    return texts, anchors


def _path_exists(ref: str, near: Path) -> bool:
    """``ref`` from the repository root, or (a document's own folder) from ``near``."""
    ref = ref.rstrip(".")
    for base in (REPO_ROOT, near):
        if any(ch in ref for ch in "*?") and any(base.glob(ref)) or (base / ref).exists():
            return True
    return False


#: written by the benchmarks when they run (not kept in the repository)
GENERATED = ("benchmarks/results",)


# ------------------------------------------------------------------------------ the tests
def test_the_extraction_finds_the_documented_commands() -> None:
    """The extractor reads what the checks below rely on (so an empty extraction cannot pass)."""
    cmds = all_commands()
    subs = {c.argv[1] for c in cmds if len(c.argv) > 1}
    assert {"launch", "status", "logs", "ls", "plot", "cancel", "resume", "push", "track"} <= subs, subs
    assert any(c.where.startswith("examples/") for c in cmds)
    assert any("--set" in c.argv for c in cmds)
    assert any(c.shows_error for c in cmds)


def test_every_documented_diloco_command_and_option_exists() -> None:
    problems = []
    for command in all_commands():
        found, pairs = _parse(command)
        problems += [f"{command.where}: {p}  [{shlex.join(command.argv)}]" for p in found]
        if not command.shows_error:
            for opt, value in pairs:
                if opt == "--set" and (p := _set_problem(value)):
                    problems.append(f"{command.where}: {p}")
            if p := _secret_problem(command, pairs):
                problems.append(f"{command.where}: {p}  [{shlex.join(command.argv)}]")
    assert not problems, "\n".join(problems)


def test_a_wrong_command_option_or_key_would_be_caught() -> None:
    """The checker itself: each kind of mismatch is reported."""
    assert _parse(Command(("diloco", "lanch"), "x"))[0]
    assert _parse(Command(("diloco", "launch", "--gpus", "H100"), "x"))[0]
    assert _parse(Command(("diloco", "cancel", "RUN", "EXTRA"), "x"))[0]
    assert not _parse(Command(("diloco", "launch", "--set", "rounds=2", "-x", "a=b", "--detach"), "x"))[0]
    assert _set_problem("inner.lrr=0.1") and not _set_problem("inner.lr=1e-3")
    assert not _resolves("diloco_serverless.terraform") and _resolves("diloco_serverless.launcher.terraform")
    launch = ("diloco", "launch", "--executor")
    assert _secret_problem(Command((), "x"), _parse(Command((*launch, "hf-jobs", "--secret", "diloco-aws-1"), "x"))[1])
    assert not _secret_problem(Command((), "x"), _parse(Command((*launch, "hf-jobs", "--secret", "MY_KEY"), "x"))[1])
    assert _secret_problem(Command((), "x"), _parse(Command((*launch, "modal", "--store", "s3://b/r"), "x"))[1])
    assert not _secret_problem(
        Command((), "x"), _parse(Command((*launch, "modal", "--store", "s3://b/r", "--secret", "s"), "x"))[1])
    assert _split("pip install x && diloco ls ./runs | head -3  # list") == [
        ["pip", "install", "x"], ["diloco", "ls", "./runs"], ["head", "-3"]]


def test_every_documented_python_module_imports() -> None:
    problems = []
    for path in doc_files():
        text = path.read_text()
        for m in MODULE_RE.finditer(text):
            if not _resolves(m.group(1).rstrip(".")):
                problems.append(f"{_rel(path)}: {m.group(1)} does not import")
        for m in FROM_IMPORT_RE.finditer(text):
            names = [n.strip() for n in m.group(2).replace("(", "").replace(")", "").split(",") if n.strip()]
            problems += [f"{_rel(path)}: from {m.group(1)} import {n} fails" for n in names
                         if not _resolves(f"{m.group(1)}.{n}")]
        for m in PY_M_RE.finditer(text):
            mod = m.group(1)
            if mod.startswith("diloco_serverless") and not _resolves(mod):
                problems.append(f"{_rel(path)}: python -m {mod} does not import")
    assert not problems, "\n".join(problems)


def test_every_named_file_link_and_section_exists() -> None:
    problems = []
    for path in doc_files() + source_files():
        if path == Path(__file__).resolve():
            continue
        text = path.read_text()
        for m in PATH_RE.finditer(text):
            ref = m.group(1)
            if text[m.end() : m.end() + 1] in ("{", "<"):  # a pattern: terraform_output_{aws,gcp}.json
                ref += "*"
            if not ref.startswith(GENERATED) and not _path_exists(ref, path.parent):
                problems.append(f"{_rel(path)}: names {ref}, which does not exist")
        for m in SECTION_RE.finditer(text):
            doc = REPO_ROOT / m.group(1)
            if not doc.exists():
                continue  # reported above
            texts, anchors = _headings(doc)
            anchor = m.group(2)
            title = re.sub(r"\s*\n\s*#?\s*", " ", m.group(3)) if m.group(3) else None  # across comment lines
            if anchor and anchor not in anchors:
                problems.append(f"{_rel(path)}: {m.group(1)}#{anchor} is not a heading of {m.group(1)}")
            if title and title not in texts:
                problems.append(f"{_rel(path)}: {m.group(1)} has no section \"{title}\"")
        if path.suffix == ".md":
            for m in re.finditer(r"\]\(([^)#\s]+)(#[\w-]+)?\)", text):
                target = m.group(1)
                if re.match(r"\w+://|mailto:", target):
                    continue
                dest = (path.parent / target).resolve()
                if not dest.exists():
                    problems.append(f"{_rel(path)}: link ({target}) leads nowhere")
                elif m.group(2) and dest.suffix == ".md" and m.group(2)[1:] not in _headings(dest)[1]:
                    problems.append(f"{_rel(path)}: link ({target}{m.group(2)}) names no heading there")
    assert not problems, "\n".join(sorted(set(problems)))


@pytest.mark.parametrize("path", doc_files(), ids=_rel)
def test_documents_are_readable(path: Path) -> None:
    assert path.read_text().strip()
