"""What every fake of the ``modal`` SDK in the executor tests shares: the module's fixed parts and how
it is put in place of the real one.

::

    mod = fake_modal_module(modal_exception, App=App, FunctionCall=FunctionCall, ...)  # the test's own parts
    install_fake_modal(monkeypatch, mod)          # ``import modal`` now gives ``mod``; fake Modal tokens set

The executor is checked against the SDK's real exception names: the caller passes the real
``modal.exception`` module (from ``pytest.importorskip("modal.exception")``, so a machine without the
SDK skips the test instead of failing to import this module).

Only what a launch hands the SDK is faked here. Whatever depends on Modal's answers (polls, results,
call graphs, logs, cancel, chains) runs the real SDK against the fake Modal server instead
(tests/support/modal_grpc_server.py), so a test cannot agree with a behaviour the SDK never has.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

__all__ = ["fake_modal_module", "install_fake_modal"]


def fake_modal_module(exception: types.ModuleType, **parts: Any) -> types.ModuleType:
    """A module named ``modal`` with ``Secret.from_name`` (gives ``("secret", name)``), ``Retries``
    (gives ``("retries", kwargs)``), ``exception`` (the module passed in) and ``parts`` as attributes."""
    mod = types.ModuleType("modal")
    mod.Secret = types.SimpleNamespace(from_name=lambda name: ("secret", name))  # type: ignore[attr-defined]
    mod.Retries = lambda **kw: ("retries", kw)  # type: ignore[attr-defined]
    mod.exception = exception  # type: ignore[attr-defined]
    for name, value in parts.items():
        setattr(mod, name, value)
    return mod


def install_fake_modal(monkeypatch: pytest.MonkeyPatch, module: types.ModuleType) -> None:
    """Make ``import modal`` give ``module`` and set fake ``MODAL_TOKEN_ID`` / ``MODAL_TOKEN_SECRET``,
    both undone when the test ends."""
    monkeypatch.setitem(sys.modules, "modal", module)
    monkeypatch.setenv("MODAL_TOKEN_ID", "ak-fake")
    monkeypatch.setenv("MODAL_TOKEN_SECRET", "as-fake")

