"""Finding 13: ``diloco logs`` prints log text through the same plain-text rendering as ``status``."""

from __future__ import annotations

from pathlib import Path

from typer.testing import CliRunner

from diloco_serverless.cli.app import app
from diloco_serverless.store.objectstore import ObjectStore
from support.fake_executor import FakeExecutor

runner = CliRunner()
ESCAPES = "\x1b]8;;https://evil.example\x07click here\x1b]8;;\x07 \x1b[2J\x1b[31mred\u202eevil\n"


def test_logs_show_terminal_escapes_as_text(workdir: Path, fake: FakeExecutor) -> None:
    launched = runner.invoke(app, ["launch", "--run-id", "r1", "--set", "rounds=3"])
    assert launched.exit_code == 0, launched.output
    url = str(workdir / "runs" / "r1")
    ObjectStore(url).put("logs/rank-0.log", ("line one\n" + ESCAPES).encode())
    for args in (["logs", url], ["logs", url, "--follow", "--interval", "0.1"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
        assert "\x1b" not in result.stdout and "\x07" not in result.stdout and "\u202e" not in result.stdout
        assert "\\x1b]8;;https://evil.example\\x07click here" in result.stdout
        assert result.stdout.splitlines()[0] == "line one"  # line breaks are kept
