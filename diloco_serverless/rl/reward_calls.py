"""Reward functions named by import path, called once per generation batch and checked.

``load_reward_funcs(["my_rewards:correct", "diloco_serverless.rl.rewards:format"])`` imports each
``module:function`` (the module from the replica's working directory or its installed packages: the
launcher ships the user's code next to the config). :func:`score` calls every function with TRL's
arguments: ``prompts`` and ``completions`` (one entry per completion, each prompt repeated
``num_generations`` times), ``completion_ids`` and every other column of the prompt records, also
one value per completion, plus ``max_completion_length``. A function that raises, returns a number
of rewards other than the number of completions, or returns something that is neither a number nor
``None`` fails the step with :class:`RewardError` naming the function and the prompt.
"""

from __future__ import annotations

import importlib
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from diloco_serverless.errors import DilocoError

RewardFunc = Callable[..., Sequence[Any]]


class RewardError(DilocoError, RuntimeError):
    """A reward function failed or broke its contract; the message names it and the prompt."""


@dataclass(frozen=True)
class NamedReward:
    name: str  # the import path as configured
    func: RewardFunc


def load_reward_funcs(paths: Sequence[str]) -> list[NamedReward]:
    """Import each ``module:function``; ``RewardError`` naming the path when it does not resolve."""
    out = []
    for path in paths:
        module_name, _, attr = path.partition(":")
        if not module_name or not attr:
            raise RewardError(f'reward function {path!r} is not "module:function"')
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise RewardError(
                f"reward function {path!r}: cannot import module {module_name!r} ({exc}); ship it with the run "
                "(next to the config) or install it in the replica image"
            ) from exc
        func = getattr(module, attr, None)
        if not callable(func):
            raise RewardError(f"reward function {path!r}: module {module_name!r} has no function {attr!r}")
        out.append(NamedReward(path, func))
    return out


def _show(prompt: Any, limit: int = 120) -> str:
    text = prompt if isinstance(prompt, str) else repr(prompt)
    return repr(text if len(text) <= limit else text[:limit] + "...")


def score(
    funcs: Sequence[NamedReward],
    prompts: Sequence[Any],
    completions: Sequence[Any],
    completion_ids: Sequence[Sequence[int]],
    columns: Mapping[str, Sequence[Any]],
    *,
    max_completion_length: int,
) -> list[list[float]]:
    """``[N][F]`` rewards (``nan`` for ``None``) of ``N`` completions under ``F`` functions."""
    n = len(completions)
    if not (len(prompts) == len(completion_ids) == n) or any(len(v) != n for v in columns.values()):
        raise ValueError("prompts, completions, completion_ids and every column need one entry per completion")
    table = [[math.nan] * len(funcs) for _ in range(n)]
    for j, reward in enumerate(funcs):
        try:
            values = reward.func(
                prompts=list(prompts), completions=list(completions), completion_ids=[list(c) for c in completion_ids],
                max_completion_length=max_completion_length, **{k: list(v) for k, v in columns.items()},
            )  # fmt: skip
        except Exception as exc:
            raise RewardError(
                f"reward function {reward.name} raised {type(exc).__name__}: {exc} (scoring {n} completions; "
                f"first prompt {_show(prompts[0])})"
            ) from exc
        try:
            got = len(values)
        except TypeError:
            got = -1
        if got != n:
            raise RewardError(
                f"reward function {reward.name} returned {got if got >= 0 else type(values).__name__} rewards for "
                f"{n} completions (first prompt {_show(prompts[0])}); return one float or None per completion"
            )
        for i, value in enumerate(values):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
                raise RewardError(
                    f"reward function {reward.name} returned {value!r} for completion {i} of prompt "
                    f"{_show(prompts[i])}; return a finite float, or None when it cannot be scored"
                )
            table[i][j] = float(value)
    return table
