"""The running package as something a remote replica can install: its metadata, its requirements,
and a wheel built from the very files this process imports.

Remote executors must run the code that launched the run, whatever installed it: a source checkout
(``pip install -e .`` or ``PYTHONPATH=.``), a wheel in some site-packages, a pipx or ``uv tool``
environment. Nothing here needs a build backend or the network:

* :func:`project_metadata` reads the name, version and requirements from the checkout's
  ``pyproject.toml`` when the package runs from one (an editable install's metadata can be older),
  else from the ``*.dist-info`` beside the installed package.
* :func:`build_wheel` zips the files of the imported package folder (:data:`PACKAGE_DIR`; no
  ``__pycache__``, bytecode or dot-files) with that metadata into a pure-Python wheel. The version
  gets a local label naming the content (``0.1.0+src.<12 hex>``), the archive is deterministic
  (sorted entries, fixed timestamps), so the same code always gives the same bytes and the same
  SHA-256; the SHA-256 is what a remote replica checks before installing it.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import re
import zipfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from email.parser import HeaderParser
from importlib.metadata import PackageNotFoundError, PathDistribution, distribution, version
from pathlib import Path

from packaging.requirements import Requirement

from diloco_serverless.config import tomllib
from diloco_serverless.executors.base import ExecutorUnavailable
from diloco_serverless.executors.user_code import UserModule

#: The folder of the imported ``diloco_serverless`` package: what remote replicas get (tests point it elsewhere).
PACKAGE_DIR = Path(__file__).resolve().parents[1]
DIST_NAME = "diloco-serverless"
#: The import name of the package, and the prefix of its files in a wheel.
IMPORT_NAME = "diloco_serverless"

_ZIP_TIME = (1980, 1, 1, 0, 0, 0)


def normalize_name(name: str) -> str:
    """PEP 503 normalisation: ``Diloco_Serverless`` -> ``diloco-serverless``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def source_checkout_root(package_dir: Path | None = None) -> Path | None:
    """The checkout holding ``package_dir`` (default :data:`PACKAGE_DIR`), or None.

    A checkout is a parent folder with a ``pyproject.toml`` whose ``[project] name`` is
    diloco-serverless (an editable install or ``PYTHONPATH=.``); a wheel in site-packages has
    none. An unreadable or malformed pyproject.toml counts as "not a checkout".
    """
    root = Path(package_dir or PACKAGE_DIR).parent
    try:
        with (root / "pyproject.toml").open("rb") as fh:
            name = tomllib.load(fh).get("project", {}).get("name", "")
    except (OSError, tomllib.TOMLDecodeError):
        return None
    return root if isinstance(name, str) and normalize_name(name) == DIST_NAME else None


@dataclass(frozen=True)
class ProjectMetadata:
    """What a wheel of the running package declares."""

    name: str
    version: str
    summary: str
    requires_python: str | None
    #: ``Requires-Dist`` strings, extras as markers (``s3fs>=2024.6; extra == 's3'``)
    requires_dist: tuple[str, ...]
    provides_extra: tuple[str, ...]
    #: the ``entry_points.txt`` text (console scripts), or None
    entry_points: str | None
    #: where this came from, for messages: ``checkout /path`` or ``installed /path/x.dist-info``
    origin: str


def _with_extra_marker(requirement: str, extra: str) -> str:
    """``"x>=1; python_version<'3.11'"`` -> ``"x>=1; (python_version<'3.11') and extra == 'dev'"``."""
    req, _, marker = requirement.partition(";")
    marker = f"({marker.strip()}) and " if marker.strip() else ""
    return f"{req.strip()}; {marker}extra == '{extra}'"


def installed_distribution(package_dir: Path) -> PathDistribution | None:
    """The ``diloco_serverless-*.dist-info`` in the folder holding ``package_dir`` (the site dir the
    package was imported from), else the installed distribution of that name, else None."""
    for info in sorted(package_dir.parent.glob("*.dist-info")):
        if normalize_name(info.name.split("-", 1)[0]) == DIST_NAME:
            return PathDistribution(info)
    try:
        dist = distribution(DIST_NAME)
    except PackageNotFoundError:
        return None
    return dist if isinstance(dist, PathDistribution) else None


def project_metadata(package_dir: Path | None = None) -> ProjectMetadata:
    """The metadata of the package at ``package_dir`` (default :data:`PACKAGE_DIR`).

    From the checkout's pyproject.toml when it runs from one, else from the installed
    ``*.dist-info``; ExecutorUnavailable when neither is there.
    """
    package_dir = Path(package_dir or PACKAGE_DIR)
    root = source_checkout_root(package_dir)
    if root is not None:
        project = tomllib.loads((root / "pyproject.toml").read_text("utf-8")).get("project", {})
        if "dependencies" in project and "version" in project:  # else dynamic: the installed metadata has them
            optional = project.get("optional-dependencies", {})
            requires = [*project["dependencies"],
                        *(_with_extra_marker(r, e) for e, reqs in optional.items() for r in reqs)]
            scripts = project.get("scripts") or {}
            entry_points = ("[console_scripts]\n" + "".join(f"{k} = {v}\n" for k, v in scripts.items())
                            if scripts else None)
            return ProjectMetadata(
                name=str(project["name"]), version=str(project["version"]), summary=str(project.get("description", "")),
                requires_python=project.get("requires-python"), requires_dist=tuple(requires),
                provides_extra=tuple(optional), entry_points=entry_points, origin=f"checkout {root}")
    dist = installed_distribution(package_dir)
    text = dist.read_text("METADATA") if dist is not None else None
    if dist is None or text is None:
        raise ExecutorUnavailable(
            f"cannot find the metadata of {DIST_NAME} at {package_dir} (not installed, no pyproject.toml next to "
            "the package); install it (pip install diloco-serverless, or pip install -e . in a checkout)")
    headers = HeaderParser().parsestr(text)
    return ProjectMetadata(
        name=headers.get("Name", DIST_NAME), version=headers.get("Version", "0"), summary=headers.get("Summary", ""),
        requires_python=headers.get("Requires-Python"), requires_dist=tuple(headers.get_all("Requires-Dist") or ()),
        provides_extra=tuple(headers.get_all("Provides-Extra") or ()), entry_points=dist.read_text("entry_points.txt"),
        origin=f"installed {getattr(dist, '_path', package_dir.parent)}")


def package_requirements(extras: Sequence[str], package_dir: Path | None = None) -> list[str]:
    """The package's requirements with ``extras``: what an image or a Job installs.

    A requirement of an extra is kept when one of ``extras`` selects it (evaluated here) and loses
    its marker (``moto[server]>=5``); a requirement with only an environment marker keeps it
    (``pywin32; sys_platform == "win32"``), for the installer to evaluate where it runs."""
    out: list[str] = []
    for text in project_metadata(package_dir).requires_dist:
        req = Requirement(text)
        if req.marker is not None and "extra" in str(req.marker):
            if not any(req.marker.evaluate({"extra": e}) for e in extras):
                continue
            req.marker = None
        out.append(str(req))
    return list(dict.fromkeys(out))


def tested_torch() -> str | None:
    """``torch==<the version this process runs>`` (a local tag such as ``+cpu`` dropped), or None without
    torch: the torch this checkout's tests ran on (CI installs one version, constraints.txt)."""
    try:
        installed = version("torch")
    except PackageNotFoundError:
        return None
    return f"torch=={installed.split('+', 1)[0]}"


def job_requirements(extras: Sequence[str], package_dir: Path | None = None) -> list[str]:
    """What a replica's image or Job installs: :func:`package_requirements` with ``torch`` pinned to
    :func:`tested_torch`. ``torch>=2.7`` alone would keep an image's own torch (HF Jobs' default
    PyTorch image has 2.7.1) or take whatever PyPI has newest when the Modal image is built; both are
    versions no test of this checkout ran on."""
    pin = tested_torch()
    reqs = package_requirements(extras, package_dir)
    if pin is None:
        return reqs
    return [pin if re.match(r"^torch(?![-_.\w])", r) else r for r in reqs]


def _package_files(package_dir: Path) -> Iterator[tuple[str, Path]]:
    """``(path in the wheel, file)`` for every file of the package, sorted; no bytecode, caches or dot-files."""
    found = []
    for dirpath, dirnames, filenames in os.walk(package_dir):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d != "__pycache__"]
        for name in filenames:
            if name.startswith(".") or name.endswith((".pyc", ".pyo")):
                continue
            path = Path(dirpath) / name
            rel = path.relative_to(package_dir).as_posix()
            found.append((f"{IMPORT_NAME}/{rel}", path))
    yield from sorted(found)


@dataclass(frozen=True)
class LocalWheel:
    """A wheel of the running package, built in memory."""

    filename: str
    data: bytes
    sha256: str
    version: str
    origin: str

    def describe(self) -> str:
        return f"{self.filename} (sha256 {self.sha256[:16]}..., from the {self.origin})"


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _metadata_text(meta: ProjectMetadata, version: str) -> str:
    lines = ["Metadata-Version: 2.1", f"Name: {meta.name}", f"Version: {version}"]
    if meta.summary:
        lines.append(f"Summary: {' '.join(meta.summary.split())}")
    if meta.requires_python:
        lines.append(f"Requires-Python: {meta.requires_python}")
    lines += [f"Provides-Extra: {e}" for e in meta.provides_extra]
    lines += [f"Requires-Dist: {r}" for r in meta.requires_dist]
    return "\n".join(lines) + "\n"


def build_wheel(package_dir: Path | None = None, *, user_modules: Sequence[UserModule] = ()) -> LocalWheel:
    """A pure-Python wheel of the package at ``package_dir`` (default: the running one), with the
    user's ``user_modules`` (reward functions named by import path) as top-level modules beside it.

    Deterministic: the same files and metadata give the same bytes. The version is the declared
    one with the local label ``+src.<first 12 hex of the content hash>``, so pip never mistakes it
    for a published release and the installed version names the code (the user's modules included).
    """
    package_dir = Path(package_dir or PACKAGE_DIR)
    if not (package_dir / "__init__.py").is_file():
        raise ExecutorUnavailable(f"cannot ship {IMPORT_NAME}: {package_dir} is not a Python package folder")
    meta = project_metadata(package_dir)
    files = [(arc, path.read_bytes()) for arc, path in _package_files(package_dir)]
    taken = {arc.split("/", 1)[0] for arc, _ in files}
    for module in user_modules:
        if module.name in taken or f"{module.name}.py" in taken or module.name == IMPORT_NAME:
            raise ExecutorUnavailable(f"cannot ship the user's {module.describe()}: the name is already in the wheel")
        files += [(arc, path.read_bytes()) for arc, path in module.files()]
        taken.add(module.name)
    files.sort()
    content = hashlib.sha256()
    for arc, data in files:
        content.update(arc.encode() + b"\0" + hashlib.sha256(data).digest())
    content.update(_metadata_text(meta, "").encode())
    version = f"{meta.version.split('+', 1)[0]}+src.{content.hexdigest()[:12]}"
    dist = re.sub(r"[-_.]+", "_", meta.name).lower()
    info = f"{dist}-{version}.dist-info"
    extra = [(f"{info}/METADATA", _metadata_text(meta, version).encode()),
             (f"{info}/WHEEL", b"Wheel-Version: 1.0\nGenerator: diloco-serverless\nRoot-Is-Purelib: true\n"
                               b"Tag: py3-none-any\n")]
    if meta.entry_points:
        extra.append((f"{info}/entry_points.txt", meta.entry_points.encode()))
    entries = [*files, *extra]
    record = "".join(f"{arc},{_record_hash(data)},{len(data)}\n" for arc, data in entries) + f"{info}/RECORD,,\n"
    entries.append((f"{info}/RECORD", record.encode()))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for arc, data in entries:
            zinfo = zipfile.ZipInfo(arc, date_time=_ZIP_TIME)
            zinfo.external_attr = 0o644 << 16
            zinfo.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(zinfo, data, compresslevel=6)
    data = buf.getvalue()
    return LocalWheel(filename=f"{dist}-{version}-py3-none-any.whl", data=data,
                      sha256=hashlib.sha256(data).hexdigest(), version=version, origin=meta.origin)
