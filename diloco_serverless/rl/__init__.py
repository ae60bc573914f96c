"""Reinforcement learning inside a replica: prompts in, rollouts out.

- :mod:`.rewards`: built-in reward functions with TRL's signature ``f(prompts, completions, **columns)``;
- :mod:`.reward_calls`: reward functions named by import path, called and checked (a raising or
  wrong-length function fails the step naming itself and the prompt);
- :mod:`.generation`: the generation backend interface and its ``transformers`` implementation;
- :mod:`.rollouts`: one generation batch (G completions per prompt, rewards, group advantages) as a
  ``compose_loss`` rollout batch.

The layer sits between ``data`` (prompts) and ``trainer`` (which runs the inner steps); it imports
``loss`` for the advantages. See docs/rl.md.
"""

from __future__ import annotations
