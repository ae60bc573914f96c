"""The wheel remote executors ship: built from the running package, however it was installed."""

from __future__ import annotations

import hashlib
import io
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from diloco_serverless.executors import _package
from diloco_serverless.executors._package import build_wheel, package_requirements, project_metadata
from diloco_serverless.executors.base import ExecutorUnavailable
from support import REPO_ROOT


def _copy_package(dest: Path) -> Path:
    package = dest / "diloco_serverless"
    shutil.copytree(REPO_ROOT / "diloco_serverless", package,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".*"))
    return package


def test_a_checkout_gives_a_deterministic_wheel_of_its_own_files() -> None:
    first, second = build_wheel(), build_wheel()
    assert first.data == second.data and first.sha256 == hashlib.sha256(first.data).hexdigest()
    assert first.filename == f"diloco_serverless-{first.version}-py3-none-any.whl"
    assert first.version.startswith("0.1.0+src.") and first.origin == f"checkout {REPO_ROOT}"
    with zipfile.ZipFile(io.BytesIO(first.data)) as zf:
        names = zf.namelist()
        metadata = zf.read(f"diloco_serverless-{first.version}.dist-info/METADATA").decode()
        record = zf.read(f"diloco_serverless-{first.version}.dist-info/RECORD").decode()
    sources = {f"diloco_serverless/{p.relative_to(_package.PACKAGE_DIR).as_posix()}"
               for p in _package.PACKAGE_DIR.rglob("*.py") if "__pycache__" not in p.parts}
    assert sources <= set(names)
    assert not [n for n in names if n.endswith(".pyc") or "/." in n or "__pycache__" in n]
    assert f"Version: {first.version}" in metadata and "Requires-Dist: torch>=2.7" in metadata
    assert "Requires-Dist: s3fs>=2024.6; extra == 's3'" in metadata and "Provides-Extra: hf" in metadata
    assert "diloco_serverless/executors/_package.py,sha256=" in record


def test_an_installed_package_ships_its_installed_files_and_metadata(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A wheel in site-packages (pipx and uv tool environments alike): no pyproject.toml, a dist-info."""
    site = tmp_path / "site-packages"
    package = _copy_package(site)
    (package / "py.typed").write_text("")
    info = site / "diloco_serverless-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: diloco-serverless\nVersion: 0.1.0+src.old\n"
                                   "Provides-Extra: s3\nRequires-Dist: torch>=2.7\n"
                                   'Requires-Dist: s3fs>=2024.6; extra == "s3"\n')
    (info / "entry_points.txt").write_text("[console_scripts]\ndiloco = diloco_serverless.cli:main\n")
    monkeypatch.setattr(_package, "PACKAGE_DIR", package)
    meta = project_metadata()
    assert meta.origin == f"installed {info}" and meta.requires_dist == ("torch>=2.7", 's3fs>=2024.6; extra == "s3"')
    assert package_requirements(["s3"]) == ["torch>=2.7", "s3fs>=2024.6"] and package_requirements([]) == ["torch>=2.7"]
    wheel = build_wheel()
    assert wheel.version.startswith("0.1.0+src.") and wheel.version != "0.1.0+src.old"
    (package / "executors" / "local.py").write_text("# changed\n")
    assert build_wheel().sha256 != wheel.sha256  # the label and the hash name the content

    # pip installs it (offline, no dependencies) and the package runs from the installed files
    path = tmp_path / wheel.filename
    path.write_bytes(wheel.data)
    target = tmp_path / "target"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(target),
                    str(path)], check=True, timeout=300)
    installed = (target / f"diloco_serverless-{wheel.version}.dist-info" / "METADATA").read_text()
    assert f"Version: {wheel.version}" in installed and (target / "diloco_serverless" / "py.typed").exists()
    assert "diloco = diloco_serverless.cli:main" in (target / f"diloco_serverless-{wheel.version}.dist-info"
                                                     / "entry_points.txt").read_text()


def test_no_metadata_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    package = _copy_package(tmp_path / "somewhere")
    monkeypatch.setattr(_package, "PACKAGE_DIR", package)
    monkeypatch.setattr(_package, "distribution", lambda name: (_ for _ in ()).throw(
        _package.PackageNotFoundError(name)))
    with pytest.raises(ExecutorUnavailable, match="cannot find the metadata of diloco-serverless"):
        build_wheel()


def test_the_replica_refuses_code_other_than_the_shipped_version(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """What a Job checks after installing: the package it imports is the shipped wheel's version."""
    from diloco_serverless.entrypoints import replica

    site = tmp_path / "site-packages"
    package = _copy_package(site)
    info = site / "diloco_serverless-0.1.0+src.aaaaaaaaaaaa.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: diloco-serverless\nVersion: 0.1.0+src.aaaaaaaaaaaa\n")
    monkeypatch.setattr(_package, "PACKAGE_DIR", package)
    monkeypatch.delenv("DILOCO_CODE_VERSION", raising=False)
    replica._check_shipped_code()  # nothing shipped: nothing to check
    monkeypatch.setenv("DILOCO_CODE_VERSION", "0.1.0+src.aaaaaaaaaaaa")
    replica._check_shipped_code()
    monkeypatch.setenv("DILOCO_CODE_VERSION", "0.1.0+src.bbbbbbbbbbbb")
    with pytest.raises(ValueError, match=r"imports diloco-serverless 0\.1\.0\+src\.aaaaaaaaaaaa .* shipped "
                                         r"0\.1\.0\+src\.bbbbbbbbbbbb"):
        replica._check_shipped_code()
    assert replica.main(["--run-url", "memory://nowhere/run", "--rank", "0"]) == 2  # a setup error: exit code 2
