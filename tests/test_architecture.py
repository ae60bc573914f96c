"""The folder listing is the architecture: layer rules, no cycles, no torch on the user's side.

The rules live in tests/support/layers.py and are drawn in docs/architecture.md. The checker is
also run on copies of the package with a rule broken on purpose, so a checker that sees nothing
cannot pass.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support import REPO_ROOT
from support.layers import ALLOWED, PACKAGE, cycles, imports, layer_of, modules, violations


def test_the_package_keeps_its_layers() -> None:
    assert violations(REPO_ROOT) == []


def test_every_layer_is_a_folder_or_one_of_a_few_modules() -> None:
    top = sorted(p.name for p in (REPO_ROOT / PACKAGE).iterdir() if p.suffix == ".py")
    assert top == ["__init__.py", "config.py", "errors.py", "testing.py"]
    assert {layer_of(m) for m in modules(REPO_ROOT)} <= set(ALLOWED)


def test_the_checker_reads_real_edges() -> None:
    edges = {(e.source, e.target) for e in imports(REPO_ROOT)}
    assert ("diloco_serverless.trainer.manager", "diloco_serverless.exchange.allreduce") in edges
    assert ("diloco_serverless.exchange.allreduce", "torch") in edges
    assert len(edges) > 200


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the package to break on purpose."""
    shutil.copytree(REPO_ROOT / PACKAGE, tmp_path / PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def _append(path: Path, text: str) -> None:
    path.write_text(path.read_text("utf-8") + "\n" + text + "\n", "utf-8")


def test_torch_in_the_launcher_is_caught(tree: Path) -> None:
    _append(tree / PACKAGE / "launcher" / "status.py", "import torch")
    found = violations(tree)
    assert len(found) == 1
    assert "diloco_serverless.launcher.status imports torch" in found[0]
    assert "layer 'launcher' may not import torch" in found[0]


def test_a_lazy_import_of_the_trainer_from_the_cli_is_caught(tree: Path) -> None:
    _append(tree / PACKAGE / "cli" / "render.py",
            "def _f() -> None:\n    from diloco_serverless.trainer.loop import ReplicaTrainer\n")
    (found,) = violations(tree)
    assert "layer 'cli' may not import layer 'trainer'" in found


def test_the_store_importing_upward_is_caught(tree: Path) -> None:
    _append(tree / PACKAGE / "store" / "retry.py", "from diloco_serverless.run import layout")
    (found,) = violations(tree)
    assert "layer 'store' may not import layer 'run'" in found


def test_a_cycle_is_caught(tree: Path) -> None:
    # quorum already imports _io; an import back closes a cycle inside one layer
    _append(tree / PACKAGE / "exchange" / "_io.py", "from diloco_serverless.exchange import quorum")
    assert cycles(tree) == [["diloco_serverless.exchange._io", "diloco_serverless.exchange.quorum"]]
    assert any(v.startswith("import cycle:") for v in violations(tree))


def test_a_new_layer_must_be_added_to_the_rules(tree: Path) -> None:
    (tree / PACKAGE / "scheduler").mkdir()
    (tree / PACKAGE / "scheduler" / "__init__.py").write_text("", "utf-8")
    assert any("layer 'scheduler' is not in the layer rules" in v for v in violations(tree))


@pytest.mark.parametrize("module", ["diloco_serverless.cli", "diloco_serverless.launcher",
                                    "diloco_serverless.executors", "diloco_serverless.run",
                                    "diloco_serverless.store", "diloco_serverless"])
def test_the_users_side_imports_no_torch(module: str) -> None:
    """Checked in a fresh interpreter: what ``import`` really loads, lazy re-exports included."""
    code = (f"import sys, {module}\n"
            "heavy = sorted(m for m in ('torch', 'torchft', 'transformers') if m in sys.modules)\n"
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == ""


@pytest.mark.slow
def test_public_names_still_import_from_the_package_root() -> None:
    code = ("from diloco_serverless import (launch, Run, RunConfig, ObjectStore, ObjectStoreAllReduce, "
            "ObjectStoreManager, MockManager, compose_loss, LossComponents, DilocoError, UserInputError)\n"
            "print(Run.__module__, ObjectStoreAllReduce.__module__, MockManager.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.split() == ["diloco_serverless.launcher.api", "diloco_serverless.exchange.allreduce",
                                  "diloco_serverless.testing"]


def test_every_error_the_package_defines_is_a_dilocoerror() -> None:
    """One base class: callers catch a family from diloco_serverless.errors, never a module's class."""
    import importlib
    import inspect

    from diloco_serverless.errors import DilocoError

    pytest.importorskip("torchft")
    defined: list[type[BaseException]] = []
    for name in modules(REPO_ROOT):
        if name.endswith(("__main__", "modal_app")):  # these run the CLI / build a Modal app on import
            continue
        module = importlib.import_module(name)
        defined += [obj for _, obj in inspect.getmembers(module, inspect.isclass)
                    if issubclass(obj, BaseException) and obj.__module__ == name]
    assert len(defined) >= 20
    assert [e.__qualname__ for e in defined if not issubclass(e, DilocoError)] == []
