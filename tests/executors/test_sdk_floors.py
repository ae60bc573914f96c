"""The vendor SDK floors in pyproject.toml hold: the installed SDKs are at least the declared floors,
and every SDK attribute (and keyword) the executors use exists in them.

Offline and fast, so CI runs it with the rest (``-m sdk`` selects it alone). It does not install the
floor versions themselves; the floors were read from the SDKs' release notes and the wheels of the
floor releases (see docs/executors.md, "SDK versions"). ``SDK_USED`` is the static list; a scan of the
executors' sources checks that the list names every ``modal.*`` / ``exc_mod.*`` / ``hub.*`` /
``self._api.*`` reference they make, so the list cannot silently fall behind the code.
"""

from __future__ import annotations

import importlib
import inspect
import re
from importlib.metadata import version
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from diloco_serverless.config import tomllib
from support import REPO_ROOT

pytestmark = pytest.mark.sdk

#: distribution -> (import name, pyproject extra that declares it)
SDKS = {"modal": ("modal", "modal"), "huggingface_hub": ("huggingface_hub", "hf")}

#: distribution -> {dotted attribute path below the module: keyword arguments the executors pass to it}
SDK_USED: dict[str, dict[str, tuple[str, ...]]] = {
    "modal": {
        "App": (),
        "App.function": ("image", "serialized", "name", "include_source", "gpu", "secrets", "timeout", "retries"),
        "App.run": ("detach", "environment_name"),
        "Function.from_name": ("environment_name",),
        "Function.with_options": ("gpu", "secrets", "timeout", "retries"),
        "Function.spawn": (),
        "Function.from_id": (),  # _remote.py: a call starts the next call of its chain (new in modal 1.6.0)
        "Function.object_id": (),
        "FunctionCall.from_id": (),
        "FunctionCall.get": ("timeout",),
        "FunctionCall.cancel": ("terminate_containers",),
        "FunctionCall.get_call_graph": (),
        "FunctionCall.logs": (),  # FunctionCall.logs.tail(entries=...), new in modal 1.5.3
        "FunctionCall.object_id": (),
        "Image.debian_slim": ("python_version",),
        "Image.pip_install": (),
        "Image.add_local_python_source": (),
        "Image.add_local_file": (),  # the user's reward modules (modal.add_user_modules)
        "Image.add_local_dir": ("ignore",),
        "Secret.from_name": ("environment_name",),
        "Secret.hydrate": (),  # preflight looks each named Secret up (modal.lookup_secrets)
        "Retries": ("max_retries", "backoff_coefficient", "initial_delay"),
        "enable_output": (),
        "exception.AuthError": (),
        "exception.ConnectionError": (),
        "exception.FunctionTimeoutError": (),
        "exception.InputCancellation": (),
        "exception.NotFoundError": (),
        "exception.OutputExpiredError": (),
        "exception.RemoteError": (),
        "exception.TimeoutError": (),
    },
    "huggingface_hub": {
        "HfApi": ("endpoint", "token"),
        "HfApi.run_job": ("image", "command", "env", "secrets", "flavor", "timeout", "attempts", "labels", "name",
                          "namespace"),
        "HfApi.inspect_job": ("job_id", "namespace"),
        "HfApi.fetch_job_logs": ("job_id", "namespace", "tail", "follow"),
        "HfApi.cancel_job": ("job_id", "namespace"),
        "HfApi.whoami": (),
        "JobHardware": (),
        "JobStage.SCHEDULING": (),
        "JobStage.RUNNING": (),
        "JobStage.COMPLETED": (),
        "JobStage.ERROR": (),
        "JobStage.CANCELED": (),
        "JobStage.DELETED": (),
        "get_token": (),
        "HfApi.create_repo": ("repo_id", "repo_type", "private", "exist_ok"),  # launcher/hub.py (--push-to-hub)
        "HfApi.upload_folder": ("repo_id", "repo_type", "folder_path", "commit_message"),
        "constants.ENDPOINT": (),
        "errors.HfHubHTTPError": (),
    },
}


#: distribution -> {what the executors use: the first release that has it}; the floor must cover all
#: (read from modal's release notes and from huggingface_hub's released wheels)
INTRODUCED_IN: dict[str, dict[str, str]] = {
    "modal": {
        "FunctionCall.logs.tail(entries=)  (ModalExecutor.logs)": "1.5.3",
        "Function.from_id  (_remote.py: the next call of a chain)": "1.6.0",
        "Function.with_options  (deployed_app launches)": "1.4.3",
        "App.function(include_source=)": "1.0.0",
        "Image.add_local_python_source": "0.67.28",
        "Image.add_local_file / add_local_dir(ignore=)  (the user's reward modules)": "0.66.40",
    },
    "huggingface_hub": {
        "HfApi.run_job(attempts=)  (retries)": "2.1.1",
        "HfApi.fetch_job_logs(tail=)": "1.16.0",
        "HfApi.run_job(labels=)": "1.4.0",
        "JobHardware": "1.4.0",
    },
}


def _floors() -> dict[str, dict[str, Version]]:
    """extra -> {distribution: floor} from pyproject.toml's optional dependencies."""
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text("utf-8"))["project"]
    out: dict[str, dict[str, Version]] = {}
    for extra, reqs in project["optional-dependencies"].items():
        for text in reqs:
            req = Requirement(text)
            floors = [Version(s.version) for s in req.specifier if s.operator in (">=", "==", "~=")]
            if floors:
                out.setdefault(extra, {})[req.name.replace("-", "_").lower()] = max(floors)
    return out


def _resolve(module: Any, dotted: str) -> Any:
    obj = module
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("dist", sorted(SDKS))
def test_installed_sdk_is_at_least_the_declared_floor(dist: str) -> None:
    module_name, extra = SDKS[dist]
    pytest.importorskip(module_name)
    floors = _floors()
    floor = floors[extra][dist]
    assert floors["dev"][dist] == floor, f"the dev extra declares another {dist} floor than [{extra}]"
    installed = Version(version(dist))
    assert installed >= floor, f"{dist} {installed} is older than the floor {floor} declared in pyproject.toml"


@pytest.mark.parametrize("dist", sorted(SDKS))
def test_the_declared_floor_has_every_api_the_executors_use(dist: str) -> None:
    """Finding 6: a floor below the release that introduced an API we call lets pip pick a broken SDK."""
    floor = _floors()[SDKS[dist][1]][dist]
    too_new = {api: v for api, v in INTRODUCED_IN[dist].items() if Version(v) > floor}
    assert not too_new, f"pyproject.toml declares {dist}>={floor}, but the executors use {too_new}"


@pytest.mark.parametrize("dist", sorted(SDKS))
def test_every_sdk_attribute_and_keyword_the_executors_use_exists(dist: str) -> None:
    module = pytest.importorskip(SDKS[dist][0])
    missing, bad_kwargs = [], []
    for dotted, kwargs in SDK_USED[dist].items():
        try:
            obj = _resolve(module, dotted)
        except AttributeError:
            missing.append(dotted)
            continue
        if not kwargs:
            continue
        params = inspect.signature(obj).parameters
        if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
            bad_kwargs += [f"{dotted}({k}=)" for k in kwargs if k not in params]
    assert not missing, f"{dist} {version(dist)} lacks {missing}"
    assert not bad_kwargs, f"{dist} {version(dist)} does not take {bad_kwargs}"


_MODAL_PATTERNS = [(r"\bmodal\.((?:[A-Z]\w*|enable_output)(?:\.\w+)?)", ""), (r"\bexc_mod\.(\w+)", "exception."),
                   (r"self\._modal\.(\w+(?:\.\w+)?)", ""), (r"\bimage\.(add_\w+)", "Image.")]
_HUB_PATTERNS = [(r"(?<![.\w])hub\.(\w+(?:\.\w+)?)", ""), (r"self\._api\.(\w+)", "HfApi."), (r"_hf\(\)\.(\w+)", ""),
                 (r"\bapi\.(create_repo|upload_folder)\b", "HfApi."), (r"from huggingface_hub import (\w+)", "")]
#: distribution -> (every module that touches the SDK, the patterns of its uses)
_USES = {
    "modal": (("diloco_serverless/executors/modal.py", "diloco_serverless/executors/_remote.py",
               "diloco_serverless/entrypoints/modal_app.py"), _MODAL_PATTERNS),
    "huggingface_hub": (("diloco_serverless/executors/hf_jobs.py", "diloco_serverless/launcher/hub.py",
                         "diloco_serverless/launcher/preflight.py"), _HUB_PATTERNS),
}
_SDK_IMPORT = {"modal": re.compile(r"^\s*(import modal\b|from modal\b)", re.M),
               "huggingface_hub": re.compile(r"^\s*(import huggingface_hub\b|from huggingface_hub\b)", re.M)}


@pytest.mark.parametrize("dist", sorted(SDKS))
def test_the_static_list_names_what_the_executors_use(dist: str) -> None:
    paths, patterns = _USES[dist]
    code = "\n".join(re.sub(r'"""(.|\n)*?"""', "", (REPO_ROOT / p).read_text("utf-8")) for p in paths)
    path = ", ".join(paths)
    used = set()
    for pattern, prefix in patterns:
        used |= {prefix + m for m in re.findall(pattern, code)}
    known = set(SDK_USED[dist]) | {d.rsplit(".", 1)[0] for d in SDK_USED[dist]}
    ignore = {"HfApi.endpoint", "exception"}  # an instance attribute; the exception module itself
    unlisted = sorted(u for u in used - known - ignore if not u.startswith("_"))
    assert not unlisted, f"{path} uses {unlisted}; add them to SDK_USED (and check the floor)"


def test_modal_sdk_module_imports_lazily() -> None:
    """``import diloco_serverless.executors`` needs neither SDK (docs/architecture.md)."""
    mod = importlib.import_module("diloco_serverless.executors.registry")
    assert "modal" in mod.EXECUTOR_KINDS and "hf-jobs" in mod.EXECUTOR_KINDS


@pytest.mark.parametrize("dist", sorted(SDKS))
def test_every_module_that_imports_an_sdk_is_scanned(dist: str) -> None:
    """A module importing the SDK that the scan above does not read could use an API the floor lacks
    (``Function.from_id`` in ``_remote.py`` did, at the old floor 1.5.3)."""
    importing = sorted(str(p.relative_to(REPO_ROOT)) for p in (REPO_ROOT / "diloco_serverless").rglob("*.py")
                       if _SDK_IMPORT[dist].search(p.read_text("utf-8")))
    assert importing, f"no module imports {dist}: the pattern is wrong"
    unscanned = [p for p in importing if p not in _USES[dist][0]]
    assert not unscanned, f"{unscanned} import {dist} but the SDK-floor scan does not read them; add them to _USES"
