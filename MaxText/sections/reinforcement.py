"""Reinforcement learning's section (rl/loss.py, rl/rewards.py, objectives/rl.py): the policy loss, the groups of
rollouts and the reward functions. What depends on the run training with RL (a reward and groups to normalise it
in, rollouts that differ, steps in whole batches of rollouts) is config_validate's, which knows the objective."""

import difflib
import math
import re
from collections.abc import Mapping
from typing import Any

from MaxText.common_types import ConfigError, shown
from MaxText.sections import Section

ALGOS = ("grpo", "gspo-token")  # `loss_algo`: the importance ratio (rl/loss.py's formulas, by these names)
AGG_MODES = ("token-mean", "sequence-mean", "sequence-mean-token-mean")  # `loss_agg_mode`: how token losses add up
BUILTIN_REWARDS = ("exact_match", "format", "math")  # reward_functions' built-ins (rl/rewards.BUILTINS)
# The config keys `check_rewards` reads.
REWARD_KEYS = (
  "num_generations",
  "reward_functions",
  "reward_weights",
  "reward_format_regex",
  "reward_timeout_seconds",
)
# The longest a user's reward call (or its module's import) may take, for a Reward made by hand: base.yml's
# reward_timeout_seconds.
TIMEOUT_S = 600.0
# "module:function": dotted Python names on both sides.
QUALIFIED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def check_rewards(values: Mapping, needed_by: str | None) -> None:
  """The reward keys from the raw config values (nothing imported): the names, the weights, the format reward's
  regular expression, and, when a run trains with them (`needed_by`: how its config asks for RL, e.g.
  "objective=rl"; None: rewards unused), that there is a reward and groups to normalise it in."""
  names, weights = list(values["reward_functions"]), list(values["reward_weights"])
  if needed_by and not names:
    raise ConfigError(
      f"{needed_by} with reward_functions=[]: RL needs a reward; set e.g. reward_functions='[\"math\"]' (built-ins: "
      f"{', '.join(BUILTIN_REWARDS)}) or '[\"my_module:my_reward\"]'"
    )
  if needed_by and values["num_generations"] < 2:
    raise ConfigError(
      f"num_generations={values['num_generations']}: GRPO's advantage compares each completion with the others of "
      "its prompt's group; set num_generations >= 2"
    )
  for name in names:
    _check_name(name)
  repeated = sorted({name for name in names if names.count(name) > 1})
  if repeated:
    raise ConfigError(
      f"reward_functions={shown(names)} lists {shown(repeated[0])} twice; list each once and weigh it by reward_weights"
    )
  if weights and len(weights) != len(names):
    raise ConfigError(
      f"reward_weights={shown(weights)} has {len(weights)} weights for {len(names)} reward_functions; give one per "
      "function, or [] to weigh each 1"
    )
  for weight in weights:
    if not isinstance(weight, (int, float)) or isinstance(weight, bool) or not math.isfinite(weight):
      raise ConfigError(f"reward_weights={shown(weights)}: {shown(weight)} is not a finite number; give numbers")
  limit = values["reward_timeout_seconds"]
  if not isinstance(limit, (int, float)) or isinstance(limit, bool) or not (math.isfinite(limit) and limit > 0):
    raise ConfigError(
      f"reward_timeout_seconds={shown(limit)}: the longest a reward call or a reward module's import may take must "
      f"be a number of seconds > 0; give e.g. reward_timeout_seconds={TIMEOUT_S:g}"
    )
  if "format" in names:
    _check_format_regex(values["reward_format_regex"])


def _check_name(name: Any) -> None:
  if not isinstance(name, str) or (name not in BUILTIN_REWARDS and not QUALIFIED.fullmatch(name)):
    close = difflib.get_close_matches(str(name), list(BUILTIN_REWARDS), n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ConfigError(
      f"reward_functions has {shown(name)}: neither a built-in ({', '.join(BUILTIN_REWARDS)}) nor 'module:function'; "
      f"{hint}give a built-in or e.g. 'my_rewards:correct' (a module on PYTHONPATH, a function in it)"
    )


def _check_format_regex(regex: str) -> None:
  if not regex:
    raise ConfigError(
      "reward_format_regex='': reward_functions has 'format'; set reward_format_regex to what a well-formed completion "
      "matches in full, e.g. reward_format_regex='<think>.*</think>\\s*<answer>.*</answer>'"
    )
  try:
    re.compile(regex, re.DOTALL)
  except re.error as e:
    raise ConfigError(
      f"reward_format_regex={shown(regex)} does not compile (re.error: {e}); fix the regular expression"
    ) from None


def check(values: Mapping) -> None:
  """The reward keys as far as they go without RL on, and the loss's numbers, whichever objective the run trains (a
  value out of range is a mistake met once RL is on)."""
  check_rewards(values, None)
  mu = values["num_iterations"]
  if mu < 1:
    raise ConfigError(f"num_iterations={mu} must be at least 1 (policy updates per batch of rollouts)")
  if values["grpo_beta"] < 0 or not 0 < values["grpo_epsilon"] < 1 or values["epsilon_high"] <= 0:
    raise ConfigError(
      f"grpo_beta={values['grpo_beta']} must be >= 0, grpo_epsilon={values['grpo_epsilon']} in (0, 1) and "
      f"epsilon_high={values['epsilon_high']} > 0"
    )


SECTION = Section(
  name="reinforcement",
  keys=(
    "loss_algo",
    "loss_agg_mode",
    "grpo_beta",
    "grpo_epsilon",
    "epsilon_high",
    "num_iterations",
    *REWARD_KEYS,
  ),
  choices={"loss_algo": ALGOS, "loss_agg_mode": AGG_MODES},
  check=check,
)
