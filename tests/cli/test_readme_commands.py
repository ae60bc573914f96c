"""The README's quickstart, as written: ``diloco launch`` and then the commands it suggests right after the
first run (``diloco ls``, ``status``, ``logs``, ``plot``, ``cancel``), read out of README.md and run in
order against a run the fake executor finished. A README edit that breaks one of them breaks this test;
so does a command that needs more than the core install (``pip install -e .``)."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from diloco_serverless.cli.app import app
from diloco_serverless.config import RunConfig
from diloco_serverless.launcher import api, preflight
from support import REPO_ROOT
from support.fake_executor import FakeExecutor

README = REPO_ROOT / "README.md"
#: What the README must keep suggesting after the first run.
POST_QUICKSTART = {"ls", "status", "logs", "plot", "cancel"}


def _section(text: str, title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## )", text, flags=re.S | re.M)
    assert match, f"README.md has no '## {title}' section"
    return match.group(1)


def _commands(block: str) -> list[list[str]]:
    """``diloco ...`` lines of a code block as argument lists (``# comments`` and ``$ `` prompts dropped)."""
    out = []
    for line in block.splitlines():
        line = line.strip().removeprefix("$ ")
        if line.startswith("diloco "):
            out.append(shlex.split(line, comments=True))
    return out


def quickstart_launch() -> list[str]:
    """The launch command the Quickstart shows (its console block's first ``$ diloco`` line)."""
    section = _section(README.read_text(), "Quickstart")
    console = re.search(r"```console\n(.*?)```", section, flags=re.S)
    assert console, "the Quickstart has no console block"
    commands = _commands("\n".join(line for line in console.group(1).splitlines() if line.startswith("$ ")))
    assert commands and commands[0][:2] == ["diloco", "launch"], commands
    return commands[0]


def post_quickstart_commands() -> list[list[str]]:
    """The commands of the first bash block after "Then, from any shell" in the Quickstart, in order."""
    section = _section(README.read_text(), "Quickstart")
    after = section.split("Then, from any shell", 1)
    assert len(after) == 2, "the Quickstart no longer says 'Then, from any shell'"
    block = re.search(r"```bash\n(.*?)```", after[1], flags=re.S)
    assert block, "no bash block after 'Then, from any shell'"
    return _commands(block.group(1))


@pytest.fixture
def finished_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeExecutor:
    """The Quickstart's launch, run in an empty folder with the fake executor standing in for the replicas."""
    monkeypatch.chdir(tmp_path)
    ex = FakeExecutor(rounds=3)
    monkeypatch.setattr(preflight, "build_executor", lambda kind, gpu, options: ex)
    monkeypatch.setattr(api, "executor_from_launch", lambda launch, run_url=None: (ex, None))
    launch_args = quickstart_launch()[1:]
    result = CliRunner().invoke(app, launch_args)
    assert result.exit_code == 0, result.output
    assert "succeeded" in result.stdout and ex.launched
    return ex


def test_readme_post_quickstart_commands_work_in_order(tmp_path: Path, finished_run: FakeExecutor) -> None:
    commands = post_quickstart_commands()
    assert {c[1] for c in commands} >= POST_QUICKSTART, commands
    (run_dir,) = (tmp_path / "runs").iterdir()
    runner = CliRunner()
    for argv in commands:
        result = runner.invoke(app, argv[1:])
        shown = " ".join(argv)
        assert result.exit_code == 0, f"`{shown}` exited {result.exit_code}: {result.output}"
        sub = argv[1]
        if sub == "ls":
            assert run_dir.name in result.stdout and "succeeded" in result.stdout, shown
        elif sub == "status":
            assert "succeeded" in result.stdout, shown
        elif sub == "logs":
            rank = int(argv[argv.index("--rank") + 1]) if "--rank" in argv else 0
            lines = result.stdout.splitlines()
            assert lines and all(line.startswith(f"rank {rank} line") for line in lines), shown
            if "--tail" in argv:
                assert len(lines) == min(20, int(argv[argv.index("--tail") + 1])), shown
        elif sub == "plot":
            out = Path(argv[argv.index("-o") + 1]) if "-o" in argv else Path("loss.png")
            assert (tmp_path / out).read_bytes().startswith(b"\x89PNG\r\n\x1a\n"), shown
        elif sub == "cancel":
            assert "already succeeded; nothing to cancel" in result.stdout, shown
    assert finished_run.cancelled == []  # cancel on a finished run touches nothing


def test_readme_commands_need_only_the_core_install() -> None:
    """`diloco plot -o loss.png` writes a PNG with matplotlib, so matplotlib is a core dependency: the
    Quickstart installs with `pip install -e .` (no extras) and then suggests it."""
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    core = {re.split(r"[<>=!~;\[ ]", dep, maxsplit=1)[0].lower() for dep in project["dependencies"]}
    assert "matplotlib" in core
    install = re.search(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    assert install and "pip install -e . && diloco launch" in install.group(1)


def test_readme_your_model_your_data_config_is_valid(tmp_path: Path) -> None:
    """The "Your model, your data" TOML loads as a RunConfig, and its launch line uses the flags it explains."""
    section = _section(README.read_text(), "Your model, your data")
    toml = re.search(r"```toml\n(.*?)```", section, flags=re.S)
    assert toml, "no toml block in 'Your model, your data'"
    path = tmp_path / "my.toml"
    path.write_text(toml.group(1))
    cfg = RunConfig.load(path)
    assert cfg.model.name != "tiny" and cfg.data.source.startswith("hf:") and cfg.data.format == "text"
    assert cfg.tracking.backends
    launch = " ".join(" ".join(c) for c in _commands(section.replace("\\\n", " ")))
    assert "--config my.toml" in launch and "--push-to-hub" in launch
    assert "docs/data.md" in section
