"""RL rewards: the reward functions named in the config, their scores, and group-normalised advantages.

reward_functions lists the rewards, each a built-in or "module:function" (a module importable from the working
directory or PYTHONPATH, dotted as `pkg.mod`; the function an attribute of it, dotted as `Class.method`);
reward_weights weighs them in the total (empty: 1 each). The call convention is TRL's (for text completions):

  fn(prompts=[str] * N, completions=[str] * N, **columns) -> a sequence of N numbers, one per completion

`prompts[i]` is the prompt of completion i as its record gives it (a string, or for a `messages` column or a prompt
of turns, its list of {"role", "content"} turns), so a prompt appears once per generation; completions are text;
`columns` holds every column of the records, each a list of N values aligned the same way (e.g. answer=[...]); a
column named `prompts` or `completions` is not passed, as those names are taken. Write **columns to take the ones
you do not use.

Built-ins (BUILTINS):
  exact_match  1 where the completion, stripped, equals str(answer) stripped; else 0. Needs the column `answer`.
  format       1 where reward_format_regex matches the whole completion (re.fullmatch, re.DOTALL: `.` crosses lines).
  math         1 where math-verify (Hugging Face's answer checker) finds the completion's answer equal to `answer`
               ("1/2", "0.5" and "\\frac{1}{2}" are one answer; a completion's answer is its \\boxed{} one, else
               its $...$ one, else its last number); text it cannot parse scores 0. Needs the column `answer`.

A reward of your own, in my_rewards.py, with reward_functions='["math", "my_rewards:short"]':

  def short(prompts, completions, **columns):
    '''1 for a completion of at most 200 characters: the math reward alone lets answers ramble.'''
    return [float(len(c) <= 200) for c in completions]

A function that raises, returns the wrong number of scores, or anything but finite numbers stops the run with one
line naming it (RewardError, a ConfigError: the user's to fix).
"""

import dataclasses
import difflib
import functools
import importlib
import inspect
import math
import numbers
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from MaxText.common_types import ConfigError, cut, shown

# Names the call convention takes for itself: a records' column of the same name is not passed.
RESERVED = ("prompts", "completions")
# math-verify's parse and verify time out by SIGALRM, which only the main thread may set (see _math_timeout).
MATH_TIMEOUT_S = 5
# Added to a group's standard deviation, as Tunix and TRL: a group whose rewards are all equal gets advantages 0.
ADVANTAGE_EPS = 1e-4
# The config keys `check` reads.
CONFIG_KEYS = ("use_rl", "num_generations", "reward_functions", "reward_weights", "reward_format_regex")
# Longest text an error quotes from what a reward function raised or returned.
QUOTED_CHARS = 200
# "module:function": dotted Python names on both sides.
_QUALIFIED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


class RewardError(ConfigError):
  """A reward function failed or broke the call convention; the message names it, and says what it did and what is
  expected."""


@dataclasses.dataclass(frozen=True)
class Reward:
  """One reward function: its name in reward_functions, the callable, its weight in the total."""

  name: str
  fn: Callable
  weight: float


# ------------------------------------------------------------------------------------------ the built-ins
def _column(reward: str, key: str, columns: Mapping) -> Sequence:
  """The column `key` a built-in needs, or a one-line RewardError naming what the records have."""
  if key not in columns:
    raise RewardError(
      f"reward function {reward} needs the column {key!r}; the records have {sorted(columns)}; give the records an "
      f"{key!r} column (train_data_columns) or choose another reward"
    )
  return columns[key]


def exact_match(prompts: Sequence[str], completions: Sequence[str], **columns) -> list[float]:
  """1 where the completion equals the answer, both stripped of surrounding whitespace."""
  del prompts
  answers = _column("exact_match", "answer", columns)
  return [float(c.strip() == str(a).strip()) for c, a in zip(completions, answers, strict=True)]


def _format(config) -> Callable:
  pattern = re.compile(config.reward_format_regex, re.DOTALL)

  def format_reward(prompts: Sequence[str], completions: Sequence[str], **columns) -> list[float]:
    """1 where reward_format_regex matches the whole completion."""
    del prompts, columns
    return [float(pattern.fullmatch(c) is not None) for c in completions]

  return format_reward


def _math_timeout() -> int | None:
  """math-verify's timeout for this thread. Its timeout sets SIGALRM, which Python allows only in the main thread;
  elsewhere it raises. So the main thread gets MATH_TIMEOUT_S seconds per parse and per comparison, and any other
  thread (a rollout or data worker) runs with no timeout: math-verify's own parsers are bounded regular expressions
  and sympy on short answers, and a pathological completion there costs time, never a wrong reward."""
  return MATH_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _math(config) -> Callable:
  del config
  try:
    import math_verify  # noqa: PLC0415 (only the math reward needs it)
  except ImportError as e:
    raise ConfigError(
      f"reward_functions has 'math' but math-verify does not import ({type(e).__name__}: {cut(_one_line(e))}); "
      "pip install math-verify (requirements.txt lists it)"
    ) from None

  def parse(text: str, seconds: int | None) -> list:
    try:
      return math_verify.parse(text, parsing_timeout=seconds)
    except Exception:  # noqa: BLE001 (text it cannot read scores 0, whatever math-verify raises)
      return []

  def math_reward(prompts: Sequence[str], completions: Sequence[str], **columns) -> list[float]:
    """1 where math-verify finds the completion's answer equal to the gold `answer`."""
    del prompts
    answers = _column("math", "answer", columns)
    seconds = _math_timeout()
    golds = {}  # Each prompt's answer repeats once per generation: parse it once.
    scores = []
    for completion, answer in zip(completions, answers, strict=True):
      if str(answer) not in golds:
        golds[str(answer)] = parse(str(answer), seconds)
      gold = golds[str(answer)]
      predicted = parse(completion, seconds)
      try:
        scores.append(float(bool(gold and predicted and math_verify.verify(gold, predicted, timeout_seconds=seconds))))
      except Exception:  # noqa: BLE001 (a comparison sympy cannot make scores 0)
        scores.append(0.0)
    return scores

  return math_reward


# Built-in name -> a factory from the config to the reward function.
BUILTINS: dict[str, Callable[[Any], Callable]] = {
  "exact_match": lambda config: exact_match,
  "format": _format,
  "math": _math,
}


# ------------------------------------------------------------------------------------------ config
def _one_line(error: BaseException) -> str:
  return " ".join(str(error).split())


def check(values: Mapping) -> None:
  """pyconfig's checks of the reward keys from the raw config values (nothing imported): the names, the weights,
  the format reward's regular expression, and that RL has a reward and groups to normalise it in."""
  names, weights = list(values["reward_functions"]), list(values["reward_weights"])
  if values["use_rl"] and not names:
    raise ConfigError(
      "use_rl=true with reward_functions=[]: RL needs a reward; set e.g. reward_functions='[\"math\"]' (built-ins: "
      f"{', '.join(BUILTINS)}) or '[\"my_module:my_reward\"]'"
    )
  if values["use_rl"] and values["num_generations"] < 2:
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
  if "format" in names:
    _check_format_regex(values["reward_format_regex"])


def _check_name(name: Any) -> None:
  if not isinstance(name, str) or (name not in BUILTINS and not _QUALIFIED.fullmatch(name)):
    close = difflib.get_close_matches(str(name), list(BUILTINS), n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ConfigError(
      f"reward_functions has {shown(name)}: neither a built-in ({', '.join(BUILTINS)}) nor 'module:function'; {hint}"
      "give a built-in or e.g. 'my_rewards:correct' (a module on PYTHONPATH, a function in it)"
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


def load(config) -> list[Reward]:
  """The configured rewards, imported and weighed; one-line ConfigError for a module that does not import, a name it
  lacks, a non-callable, or the math reward without math-verify."""
  check({key: getattr(config, key) for key in CONFIG_KEYS})
  names = list(config.reward_functions)
  weights = list(config.reward_weights) or [1.0] * len(names)
  return [Reward(name, _resolve(name, config), float(weight)) for name, weight in zip(names, weights, strict=True)]


def _resolve(name: str, config) -> Callable:
  if name in BUILTINS:
    return BUILTINS[name](config)
  module_name, attribute = name.split(":")
  try:
    module = importlib.import_module(module_name)
  except Exception as e:  # noqa: BLE001 (whatever the user's module raises on import is reported in one line)
    raise ConfigError(
      f"reward_functions has {name!r}: module {module_name!r} does not import ({type(e).__name__}: "
      f"{cut(_one_line(e), QUOTED_CHARS)}); put it on PYTHONPATH or fix it"
    ) from None
  try:
    fn = functools.reduce(getattr, attribute.split("."), module)
  except AttributeError:
    raise ConfigError(
      f"reward_functions has {name!r}: module {module_name!r} ({getattr(module, '__file__', None)}) has no "
      f"{attribute!r}; name a function it defines"
    ) from None
  if not callable(fn):
    raise ConfigError(
      f"reward_functions has {name!r}: {module_name}.{attribute} is a {type(fn).__name__}, not a function; name a "
      "function fn(prompts, completions, **columns)"
    )
  _check_signature(name, fn)
  return fn


def _check_signature(name: str, fn: Callable) -> None:
  """Refuse at start-up, not after the first rollouts, a function that cannot take prompts= and completions=."""
  try:
    signature = inspect.signature(fn)
  except (TypeError, ValueError):  # A callable whose signature Python cannot read (some builtins): it will tell.
    return
  try:
    signature.bind_partial(prompts=[], completions=[])
  except TypeError as e:
    raise ConfigError(
      f"reward_functions has {name!r}: its signature {cut(str(signature), QUOTED_CHARS)} cannot take prompts= and "
      f"completions= ({e}); define it as fn(prompts, completions, **columns)"
    ) from None


# ------------------------------------------------------------------------------------------ scores
def score(
  rewards: Sequence[Reward], prompts: Sequence[str], completions: Sequence[str], columns: Mapping[str, Sequence]
) -> np.ndarray:
  """Each reward of each completion.

  prompts, completions: [N] text, prompts[i] the prompt of completion i; columns: name -> [N] values.
  Returns scores [N, F] float64, column f from rewards[f] (unweighted: `total` weighs them).
  """
  n = len(completions)
  assert len(prompts) == n and all(len(v) == n for v in columns.values()), "one prompt and record per completion"
  scores = np.zeros((n, len(rewards)), np.float64)
  for f, reward in enumerate(rewards):
    kwargs = {key: list(value) for key, value in columns.items() if key not in RESERVED}  # A copy each: fns may mutate.
    try:
      returned = reward.fn(prompts=list(prompts), completions=list(completions), **kwargs)
    except RewardError:
      raise
    except Exception as e:  # noqa: BLE001 (any error of a user's function is reported in one line, naming it)
      message = cut(_one_line(e), QUOTED_CHARS)
      raise RewardError(f"reward function {reward.name} raised {type(e).__name__}{': ' if message else ''}{message}") from e
    scores[:, f] = _as_scores(reward.name, returned, n)
  return scores


def _number(value: Any) -> float | None:
  """value as a float when it is a real number (Python's or NumPy's, or a 0-d array such as a JAX scalar)."""
  if isinstance(value, (numbers.Real, np.bool_)):
    number = value
  elif hasattr(value, "__array__") and np.shape(value) == () and np.asarray(value).dtype.kind in "biuf":
    number = np.asarray(value).item()
  else:
    return None
  try:
    return float(number)
  except OverflowError:  # An int beyond a float's range: not finite, and reported so.
    return math.inf


def _as_scores(name: str, returned: Any, n: int) -> np.ndarray:
  """What a reward function returned, as [N] finite float64, or a RewardError saying what it returned instead."""
  expected = f"expected a sequence of {n} numbers, one per completion"
  try:
    length = None if isinstance(returned, (str, bytes, Mapping)) else len(returned)
  except TypeError:
    length = None
  if length is None:
    raise RewardError(
      f"reward function {name} returned {type(returned).__name__} {shown(returned, QUOTED_CHARS)}; {expected}"
    )
  if length != n:
    raise RewardError(f"reward function {name} returned {type(returned).__name__} of length {length}; {expected}")
  values = np.zeros(n, np.float64)
  for i, value in enumerate(returned):
    number = _number(value)
    if number is None or not math.isfinite(number):
      what = "a non-number" if number is None else "a non-finite value"
      raise RewardError(
        f"reward function {name} returned {what} at index {i}: {shown(value, QUOTED_CHARS)}; {expected}, all finite"
      )
    values[i] = number
  return values


def total(rewards: Sequence[Reward], scores: np.ndarray) -> np.ndarray:
  """The weighted sum of each completion's rewards. scores [N, F] (from `score`) -> [N] float64."""
  weights = np.array([reward.weight for reward in rewards], np.float64)
  assert scores.shape[1:] == weights.shape, f"scores {scores.shape} for {len(rewards)} rewards"
  return np.asarray(scores, np.float64) @ weights


def group_advantages(totals: np.ndarray, num_generations: int) -> np.ndarray:
  """GRPO's group-relative advantage (Shao et al. 2024, section 4.1.2, outcome supervision): each completion's total
  reward less its group's mean, over its group's standard deviation plus ADVANTAGE_EPS.

  A group is `num_generations` consecutive completions (one prompt's). The standard deviation is the sample one
  (ddof=1), as Tunix's grpo advantage estimator and TRL (torch.std) compute it; a group of equal rewards gets 0
  everywhere, so a prompt every completion answers alike teaches nothing, as GRPO means.

  totals [N] -> advantages [N] float32.
  """
  rewards = np.asarray(totals, np.float64)
  if num_generations < 2 or rewards.ndim != 1 or rewards.size % num_generations:
    raise ValueError(f"{rewards.shape} rewards do not form groups of num_generations={num_generations} (>= 2)")
  groups = rewards.reshape(-1, num_generations)
  centred = groups - groups.mean(axis=1, keepdims=True)
  return (centred / (groups.std(axis=1, ddof=1, keepdims=True) + ADVANTAGE_EPS)).reshape(-1).astype(np.float32)
