"""The user's modules a run's replicas import (``rl.reward_funcs``), found at launch and handed to the
executor that ships them (see :mod:`diloco_serverless.executors.user_code`).

:func:`check_user_modules` runs in preflight: a reward module that is not on this machine is a
LaunchError before anything is created. :func:`hand_user_modules` gives the executor the modules
(``set_user_modules``: Modal adds them to the image, HF Jobs to the shipped wheel, the local executor
to the replicas' ``PYTHONPATH``) and returns a note when an executor cannot ship them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from diloco_serverless.config import RunConfig
from diloco_serverless.errors import ConfigError, LaunchError
from diloco_serverless.executors import ServerlessExecutor
from diloco_serverless.executors.user_code import UserModule, resolve_user_modules, reward_function_paths

logger = logging.getLogger(__name__)


def check_user_modules(cfg: RunConfig) -> list[UserModule]:
    """The user's own modules among the config's reward functions (none for a supervised run);
    LaunchError naming the function and what to do when one cannot be found or lacks the function."""
    paths = reward_function_paths(cfg.loss.channel1, cfg.rl.reward_funcs)
    try:
        return resolve_user_modules(paths)
    except ConfigError as e:
        raise LaunchError(str(e)) from None


def hand_user_modules(executor: ServerlessExecutor, modules: Sequence[UserModule]) -> list[str]:
    """Give ``executor`` the modules to ship; the notes to show when it has no way to ship them."""
    if not modules:
        return []
    setter = getattr(executor, "set_user_modules", None)
    if callable(setter):
        setter(list(modules))
        for module in modules:
            logger.info("shipping the user's %s with the replicas' code", module.describe())
        return []
    note = (f"the {type(executor).__name__} executor does not ship your code: its replicas must already be able to "
            f"import {'; '.join(m.describe() for m in modules)}")
    logger.warning("%s", note)
    return [note]
