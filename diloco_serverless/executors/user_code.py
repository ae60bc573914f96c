"""The user's own modules a run names by import path (``rl.reward_funcs``), found on this machine so
that remote executors can ship them with the package.

``rl.reward_funcs = ["my_rewards:correct"]`` names a module that remote replicas must import. An
installed distribution (``math_verify``, this package) reaches them through the image's or the Job's
requirements; a module that is only a file or a folder here does not. :func:`resolve_user_modules`
finds each named module *without importing it* (``importlib.machinery.PathFinder``, searching the
working directory first, then ``sys.path``) and sorts it:

* the package itself, the standard library and anything under a ``site-packages`` folder are
  *installed*: nothing is shipped, the replica imports its own copy;
* anything else (``my_rewards.py`` in the working directory, a ``my_rewards/`` package on
  ``PYTHONPATH``, an editable install's source folder) is a :class:`UserModule`: its top-level
  module or package, every file in it (no dot-files, caches or bytecode), is what an executor ships.
  Modal adds it to the image at ``/root/<name>`` (where ``add_local_python_source`` puts the package,
  the replicas' working directory), HF Jobs adds it to the wheel it builds of the package (installed
  in the Job, checked by SHA-256 before), the local executor puts its folder on the replicas'
  ``PYTHONPATH``.

A module that cannot be found, a submodule its package lacks, a file that does not parse or that
plainly defines no such function is a :class:`~diloco_serverless.errors.ConfigError` naming the
reward function and what to do, raised at launch before anything is created.
"""

from __future__ import annotations

import ast
import importlib.machinery
import os
import site
import sys
import sysconfig
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from diloco_serverless.errors import ConfigError

#: the package itself: every executor ships or installs it already
PACKAGE_NAME = "diloco_serverless"
#: the most bytes of user code shipped with a run (a reward module is source, not data)
MAX_USER_CODE_BYTES = 16 * 2**20
#: where Modal puts shipped source in a container (``modal.mount.ROOT_DIR``; the container's working directory)
MODAL_ROOT = "/root"


@dataclass(frozen=True)
class UserModule:
    """A top-level module or package of the user's that replicas must get from the launcher."""

    #: the top-level import name (``my_rewards`` for ``my_rewards.scoring:correct``)
    name: str
    #: the ``.py`` file, or the package folder
    path: Path
    #: the configured functions that need it (``my_rewards:correct``), for messages
    used_by: tuple[str, ...]

    @property
    def is_package(self) -> bool:
        return self.path.is_dir()

    @property
    def root(self) -> Path:
        """The folder that holds it: what goes on ``sys.path`` to import it."""
        return self.path.parent

    def files(self) -> list[tuple[str, Path]]:
        """``(path relative to the import root, file)`` of every file shipped, sorted: ``my_rewards.py``,
        or ``my_pkg/__init__.py``, ``my_pkg/data.json``... (no dot-files, ``__pycache__`` or bytecode)."""
        if not self.is_package:
            return [(self.path.name, self.path)]
        found = []
        for dirpath, dirnames, filenames in os.walk(self.path):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__")
            for name in filenames:
                if name.startswith(".") or name.endswith((".pyc", ".pyo")):
                    continue
                path = Path(dirpath) / name
                found.append((f"{self.name}/{path.relative_to(self.path).as_posix()}", path))
        return sorted(found)

    def describe(self) -> str:
        kind = "package" if self.is_package else "module"
        return f"{kind} {self.name} ({self.path}, for {', '.join(self.used_by)})"


def reward_function_paths(channel1: str, reward_funcs: Sequence[str]) -> list[str]:
    """The reward functions a config's replicas import: ``rl.reward_funcs`` when channel 1 is RL."""
    return list(reward_funcs) if channel1 != "lm" else []


def search_path(extra: Iterable[str] = ()) -> list[str]:
    """Where modules are looked for: ``extra``, the working directory, then ``sys.path`` (``""`` is the
    working directory), without repeats."""
    cwd = os.getcwd()
    out: list[str] = []
    for entry in [*extra, cwd, *sys.path]:
        entry = os.path.abspath(entry or cwd)
        if entry not in out:
            out.append(entry)
    return out


def installed_roots() -> list[Path]:
    """The folders of installed code: the standard library and every ``site-packages`` of this Python."""
    paths = sysconfig.get_paths()
    roots = [paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")]
    try:
        roots += site.getsitepackages()
    except AttributeError:  # some virtualenv layouts lack it
        pass
    roots.append(site.getusersitepackages())
    out = []
    for root in roots:
        if root and Path(root).is_dir():
            resolved = Path(root).resolve()
            if resolved not in out:
                out.append(resolved)
    return out


def _is_installed(path: Path, roots: Sequence[Path]) -> bool:
    resolved = path.resolve()
    return any(resolved == r or r in resolved.parents for r in roots) or "site-packages" in resolved.parts \
        or "dist-packages" in resolved.parts


def resolve_user_modules(import_paths: Sequence[str], *, path: Sequence[str] | None = None,
                         setting: str = "rl.reward_funcs") -> list[UserModule]:
    """The user's modules among ``import_paths`` (``"module:function"``), one per top-level name, in
    order; installed ones are left out. ``path`` is where to look (default :func:`search_path`).

    ConfigError (naming the function, where it looked and what to do) when a module is not found,
    is not Python source, or plainly lacks the function; nothing is imported."""
    where = list(path) if path is not None else search_path()
    roots = installed_roots()
    found: dict[str, UserModule] = {}
    for spec_text in import_paths:
        module_name, _, attr = spec_text.partition(":")
        parts = module_name.split(".")
        if not attr or not all(p.isidentifier() for p in parts):
            raise ConfigError(f'{setting}: {spec_text!r} is not "module:function" (e.g. "my_rewards:correct")')
        top = parts[0]
        if top == PACKAGE_NAME or top in sys.builtin_module_names:
            continue
        spec = importlib.machinery.PathFinder.find_spec(top, where)
        if spec is None:
            raise ConfigError(
                f"{setting}: cannot find module {top!r} of reward function {spec_text!r} on this machine (looked in "
                f"the working directory {os.getcwd()} and sys.path); put {top}.py (or the package folder {top}/) in "
                "the directory you launch from, add its folder to PYTHONPATH, or install it (and in the replicas' "
                "image, e.g. --image or extras)")
        location = _location(spec)
        if location is None:  # a namespace package spread over folders: nothing single to ship
            raise ConfigError(
                f"{setting}: module {top!r} of reward function {spec_text!r} is a namespace package (no "
                f"__init__.py in {', '.join(spec.submodule_search_locations or [])}); add an __init__.py so it "
                "can be shipped, or install it in the replicas' image")
        if _is_installed(location, roots):
            continue
        if location.is_file() and location.suffix != ".py":
            raise ConfigError(
                f"{setting}: module {top!r} of reward function {spec_text!r} is {location}, not Python source; "
                "only source modules ship with a run: install it in the replicas' image instead")
        source = _submodule_file(location, parts[1:], spec_text, setting)
        _check_defines(source, attr, spec_text, setting)
        known = found.get(top)
        used_by = (*known.used_by, spec_text) if known is not None else (spec_text,)
        found[top] = UserModule(name=top, path=location, used_by=used_by)
    modules = list(found.values())
    total = sum(f.stat().st_size for m in modules for _, f in m.files())
    if total > MAX_USER_CODE_BYTES:
        raise ConfigError(
            f"{setting}: the modules to ship ({', '.join(m.describe() for m in modules)}) hold {total / 2**20:.1f} "
            f"MiB, more than {MAX_USER_CODE_BYTES // 2**20} MiB; keep reward code small (data belongs in the "
            "prompt columns or the store) or install it in the replicas' image")
    return modules


def _location(spec: importlib.machinery.ModuleSpec) -> Path | None:
    """The module's ``.py`` file or its package folder; None for a namespace package."""
    if spec.origin is None or spec.origin == "namespace":
        return None
    origin = Path(spec.origin)
    return origin.parent if spec.submodule_search_locations is not None else origin


def _submodule_file(location: Path, rest: Sequence[str], spec_text: str, setting: str) -> Path:
    """The source file of ``top.rest...`` inside the top-level module at ``location``."""
    if not rest:
        return location / "__init__.py" if location.is_dir() else location
    folder = location
    for i, part in enumerate(rest):
        if not folder.is_dir():
            break
        last = i == len(rest) - 1
        if last and (folder / f"{part}.py").is_file():
            return folder / f"{part}.py"
        if (folder / part / "__init__.py").is_file():
            folder = folder / part
            if last:
                return folder / "__init__.py"
            continue
        break
    raise ConfigError(
        f"{setting}: {location} has no module {'.'.join(rest)!r} for reward function {spec_text!r}; check the "
        "import path (dots separate package folders, the function follows ':')")


def _check_defines(source: Path, attr: str, spec_text: str, setting: str) -> None:
    """ConfigError when ``source`` does not parse, or binds nothing named ``attr`` at its top level
    while it could not get it otherwise (no ``import *``, no module ``__getattr__``)."""
    try:
        tree = ast.parse(source.read_bytes(), filename=str(source))
    except SyntaxError as exc:
        raise ConfigError(
            f"{setting}: {source} (reward function {spec_text!r}) does not parse: {exc.msg} at line {exc.lineno}; "
            "fix it before launching") from None
    names: set[str] = set()
    stack: list[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    return
                names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        else:
            for field in ("body", "orelse", "finalbody", "handlers"):  # if / try / with / for blocks bind names too
                stack.extend(n for n in getattr(node, field, ()) if isinstance(n, ast.AST))
    if attr not in names and "__getattr__" not in names:
        raise ConfigError(
            f"{setting}: {source} defines no function {attr!r} (reward function {spec_text!r}); check the name "
            "after ':'")
