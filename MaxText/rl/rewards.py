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

A function that raises (SystemExit and every other BaseException included), returns the wrong number of scores or
anything but finite numbers, gives a weighted total beyond float64's range, or takes longer than
reward_timeout_seconds stops the run with one line naming it (RewardError, a ConfigError: the user's to fix).
KeyboardInterrupt is the user's, not the function's: it stays a KeyboardInterrupt.

A "module:function" is code the config runs: its module is imported at start (within reward_timeout_seconds too),
and `Reward.module` says which module and file, for the run to print.

Where the functions run: a user's function on a worker thread that the caller waits for, at most
reward_timeout_seconds (score, _on_worker): a function that never returns cannot be stopped (no thread can be), but
the run is no longer held by it: it stops with one line and exits, the thread being a daemon, which exit does not
wait for. The caller, on the main thread, stays in a wait that a signal interrupts, so SIGTERM and SIGINT reach the
training loop's handlers (cli.StopRequest), never the user's code. A thread, not a subprocess: the function keeps
the process's state (a model a module loaded, its caches) and needs nothing picklable. The costs: a call into C that
holds the GIL (a regular expression that backtracks for ever, say) blocks the waiting thread too, so no thread bounds
it; and code that sets a signal handler fails off the main thread (math-verify's parse and verify with their default
SIGALRM timeouts raise ValueError there: pass parsing_timeout=None and timeout_seconds=None, and the call's limit
bounds them; the error says so). The built-ins run on the caller's thread instead: they are ours, and the math
reward's per-parse timeouts use SIGALRM, which only the main thread may set (_math_timeout); on a worker thread it
would parse with no bound at all.
"""

import dataclasses
import functools
import importlib
import inspect
import itertools
import math
import numbers
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import Any

import numpy as np

from MaxText.common_types import ConfigError, cut, shown
from MaxText.sections import implement
from MaxText.sections.reinforcement import BUILTIN_REWARDS, REWARD_KEYS, TIMEOUT_S, check_rewards

# Names the call convention takes for itself: a records' column of the same name is not passed.
RESERVED = ("prompts", "completions")
# math-verify's parse and verify time out by SIGALRM, which only the main thread may set (see _math_timeout).
MATH_TIMEOUT_S = 5
# Added to a group's standard deviation, as Tunix and TRL: a group whose rewards are all equal gets advantages 0.
ADVANTAGE_EPS = 1e-4
# Longest text an error quotes from what a reward function raised or returned.
QUOTED_CHARS = 200


class RewardError(ConfigError):
  """A reward function failed or broke the call convention; the message names it, and says what it did and what is
  expected."""


@dataclasses.dataclass(frozen=True)
class Reward:
  """One reward function: its name in reward_functions, the callable, its weight in the total."""

  name: str
  fn: Callable
  weight: float
  builtin: bool = False  # one of BUILTINS: called on the caller's thread (see the module's docstring)
  timeout: float = TIMEOUT_S  # reward_timeout_seconds: the longest a call of a user's function may take
  module: str = ""  # the module imported for it, "name (file)"; "" for a built-in


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
BUILTINS: dict[str, Callable[[Any], Callable]] = implement(
  BUILTIN_REWARDS, {"exact_match": lambda config: exact_match, "format": _format, "math": _math}
)


# ------------------------------------------------------------------------------------------ config
def _one_line(error: BaseException) -> str:
  return " ".join(str(error).split())


def load(config) -> list[Reward]:
  """The configured rewards, imported and weighed; one-line ConfigError for a module that does not import (or takes
  longer than reward_timeout_seconds to), a name it lacks, a non-callable, or the math reward without math-verify."""
  check_rewards({key: getattr(config, key) for key in REWARD_KEYS}, None)  # (a run's need of them: pyconfig's check)
  names = list(config.reward_functions)
  weights = list(config.reward_weights) or [1.0] * len(names)
  limit = float(config.reward_timeout_seconds)
  loaded = []
  for name, weight in zip(names, weights, strict=True):
    if name in BUILTINS:
      loaded.append(Reward(name, BUILTINS[name](config), float(weight), builtin=True, timeout=limit))
      continue
    try:  # The module's code, and whatever its attributes run, on a worker thread the import may not block for ever.
      fn, module = _on_worker(functools.partial(_resolve, name), limit, f"import for {name}")
    except _Late:
      raise ConfigError(
        f"reward_functions has {name!r}: importing module {name.split(':')[0]!r} did not finish within {limit:g} s "
        f"(reward_timeout_seconds={limit:g}); a reward module must not block at import: fix it, or raise "
        "reward_timeout_seconds if its import needs longer"
      ) from None
    loaded.append(Reward(name, fn, float(weight), timeout=limit, module=module))
  return loaded


def imported(rewards: Sequence[Reward]) -> str | None:
  """The line a run prints of the modules its reward_functions imported (their code ran at start, and runs at each
  rollout), or None when every reward is a built-in."""
  modules = list(dict.fromkeys(reward.module for reward in rewards if reward.module))
  if not modules:
    return None
  return f"reward_functions imported and run code from: {', '.join(modules)}"


def _resolve(name: str) -> tuple[Callable, str]:
  """A name "module:function" -> (the function, "module (its file)"); one-line ConfigErrors. Runs the user's code."""
  module_name, attribute = name.split(":")
  try:
    module = importlib.import_module(module_name)
  except KeyboardInterrupt:
    raise
  except BaseException as e:  # noqa: BLE001 (whatever the user's module raises on import, sys.exit too, is one line)
    raise ConfigError(
      f"reward_functions has {name!r}: module {module_name!r} does not import ({_described(e)}); put it on PYTHONPATH "
      "or fix it"
    ) from None
  where = f"{module_name} ({getattr(module, '__file__', None) or 'no file'})"
  try:
    fn = functools.reduce(getattr, attribute.split("."), module)
  except AttributeError:
    raise ConfigError(
      f"reward_functions has {name!r}: module {module_name!r} ({getattr(module, '__file__', None)}) has no "
      f"{attribute!r}; name a function it defines"
    ) from None
  except Exception as e:  # noqa: BLE001 (a module's __getattr__ or a descriptor of the user's that raises)
    raise ConfigError(f"reward_functions has {name!r}: reading {attribute!r} of {where} raised {_described(e)}") from None
  if not callable(fn):
    raise ConfigError(
      f"reward_functions has {name!r}: {module_name}.{attribute} is a {type(fn).__name__}, not a function; name a "
      "function fn(prompts, completions, **columns)"
    )
  _check_signature(name, fn)
  return fn, where


def _check_signature(name: str, fn: Callable) -> None:
  """Refuse at start-up, not after the first rollouts, a function that cannot take prompts= and completions=."""
  try:
    signature = inspect.signature(fn)
  except Exception:  # noqa: BLE001 (a callable whose signature Python cannot read, some builtins: it will tell)
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

  A user's function runs on a worker thread, waited for at most its reward.timeout seconds (see the module's
  docstring); a built-in on this thread, where an exception other than its RewardError (a bug, or the training
  loop's signal, cli.StopRequest.Interrupted) propagates as it is.
  """
  n = len(completions)
  assert len(prompts) == n and all(len(v) == n for v in columns.values()), "one prompt and record per completion"
  scores = np.zeros((n, len(rewards)), np.float64)
  for f, reward in enumerate(rewards):
    kwargs = {key: list(value) for key, value in columns.items() if key not in RESERVED}  # A copy each: fns may mutate.
    kwargs |= {"prompts": list(prompts), "completions": list(completions)}
    if reward.builtin:
      scores[:, f] = _as_scores(reward.name, reward.fn(**kwargs), n)
      continue
    try:
      scores[:, f] = _on_worker(functools.partial(_call, reward, kwargs, n), reward.timeout, f"reward {reward.name}")
    except _Late:
      raise RewardError(
        f"reward function {reward.name} did not return within {reward.timeout:g} s (reward_timeout_seconds="
        f"{reward.timeout:g}); make it return sooner, or raise reward_timeout_seconds if it needs longer"
      ) from None
  return scores


def _call(reward: Reward, kwargs: dict, n: int) -> np.ndarray:
  """A user's reward function called, and what it returned read, on the worker thread (both run the user's code:
  a returned object's __len__, __iter__ and __float__ too); anything raised is a RewardError naming the function,
  but KeyboardInterrupt, which stays the user's interrupt."""
  try:
    return _as_scores(reward.name, reward.fn(**kwargs), n)
  except (RewardError, KeyboardInterrupt):
    raise
  except BaseException as e:  # noqa: BLE001 (sys.exit, GeneratorExit, a BaseException of its own: all one line)
    described = _described(e)
    hint = ""
    if isinstance(e, SystemExit):
      hint = "; a reward function returns its scores, it cannot end the run"
    elif isinstance(e, ValueError) and ("main thread" in described or "threaded environment" in described):
      hint = (
        "; reward functions run on a worker thread, where no signal handler can be set: call math-verify's parse "
        "and verify with parsing_timeout=None and timeout_seconds=None (reward_timeout_seconds bounds the call), or "
        "use the built-in 'math'"
      )
    raise RewardError(f"reward function {reward.name} raised {described}{hint}") from None


class _Late(Exception):
  """The work given to _on_worker did not finish in time."""


def _on_worker(work: Callable[[], Any], timeout: float, name: str) -> Any:
  """work() on a daemon thread named `name`, waited for at most `timeout` seconds: its result, or what it raised,
  raised here; _Late when it is still running (it is left to run: a thread cannot be stopped).

  A daemon thread, not a concurrent.futures pool's, which interpreter exit would wait for: a run that stops because
  a reward hangs must still exit. The wait (a lock's) is interrupted by a signal on the main thread, whose handler's
  exception (cli.StopRequest.Interrupted, KeyboardInterrupt) then propagates from here."""
  outcome = []

  def run():
    try:
      outcome.append((True, work()))
    except BaseException as e:  # noqa: BLE001 (handed to the waiting thread, which raises it)
      outcome.append((False, e))

  thread = threading.Thread(target=run, name=name, daemon=True)
  thread.start()
  thread.join(min(timeout, threading.TIMEOUT_MAX))
  if not outcome:
    raise _Late
  finished, value = outcome[0]
  if not finished:
    raise value
  return value


def _described(error: BaseException) -> str:
  """`Type: message` of a user's exception, one line cut to QUOTED_CHARS (or `Type` alone); str() is the user's
  code too, so a failing one is survived."""
  try:
    message = cut(_one_line(error), QUOTED_CHARS)
  except Exception:  # noqa: BLE001 (an exception whose __str__ raises)
    message = "(its message cannot be shown)"
  return f"{type(error).__name__}{': ' if message else ''}{message}"


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
  try:  # A set has a length, but no order to match the completions'.
    length = None if isinstance(returned, (str, bytes, Mapping, AbstractSet)) else len(returned)
  except TypeError:
    length = None
  if length is None:
    raise RewardError(
      f"reward function {name} returned {type(returned).__name__} {shown(returned, QUOTED_CHARS)}; {expected}"
    )
  if length != n:
    raise RewardError(f"reward function {name} returned {type(returned).__name__} of length {length}; {expected}")
  items = list(itertools.islice(returned, n + 1))  # An object whose length and iteration disagree is read no further.
  if len(items) != n:
    raise RewardError(
      f"reward function {name} returned {type(returned).__name__} of length {n} whose iteration gives "
      f"{'more' if len(items) > n else len(items)} values; {expected}"
    )
  values = np.zeros(n, np.float64)
  for i, value in enumerate(items):
    number = _number(value)
    if number is None or not math.isfinite(number):
      what = "a non-number" if number is None else "a non-finite value"
      raise RewardError(
        f"reward function {name} returned {what} at index {i}: {shown(value, QUOTED_CHARS)}; {expected}, all finite"
      )
    values[i] = number
  return values


def total(rewards: Sequence[Reward], scores: np.ndarray) -> np.ndarray:
  """The weighted sum of each completion's rewards. scores [N, F] (from `score`) -> [N] float64.

  Finite scores can still weigh and add up beyond float64's range (2 x 1e308): that is refused, naming the reward
  functions whose scores did it, rather than passed on as an infinite total and NaN advantages."""
  weights = np.array([reward.weight for reward in rewards], np.float64)
  assert scores.shape[1:] == weights.shape, f"scores {scores.shape} for {len(rewards)} rewards"
  with np.errstate(over="ignore", invalid="ignore"):
    totals = np.asarray(scores, np.float64) @ weights
    bad = np.flatnonzero(~np.isfinite(totals))
    if not bad.size:
      return totals
    row = int(bad[0])
    weighted = scores[row] * weights
  terms = " + ".join(f"{r.weight:g} x {scores[row, f]:g}" for f, r in enumerate(rewards))
  blamed = [r.name for r, w in zip(rewards, weighted, strict=True) if not math.isfinite(w)]
  blamed = blamed or [r.name for r, w in zip(rewards, weighted, strict=True) if w != 0]
  raise RewardError(
    f"the total reward of completion {row} is {terms} = {totals[row]}: beyond float64's range, from reward "
    f"function{'s' if len(blamed) > 1 else ''} {', '.join(blamed)} ({bad.size} of {totals.size} completions); "
    "return rewards of a size that can be weighed and added (well within 1e308)"
  )


def _power_of_two_scale(values: np.ndarray) -> np.ndarray:
  """Per row of `values` [..., K], the exponent e with max |value| in [2^(e-1), 2^e) (0 for a row of zeros):
  dividing by 2^e is exact, and brings the row within [-1, 1], where sums and squares cannot overflow."""
  return np.frexp(np.abs(values).max(axis=-1, keepdims=True))[1]


def mean_and_std(values: np.ndarray) -> tuple[float, float]:
  """The mean and (population) standard deviation of finite float64 `values`, whatever their size (np.mean of two
  1e308s overflows); for the logged metrics."""
  values = np.asarray(values, np.float64).reshape(-1)
  if not values.size:
    return math.nan, math.nan
  exponent = _power_of_two_scale(values)
  scaled = np.ldexp(values, -exponent)
  return float(np.ldexp(scaled.mean(), exponent[0])), float(np.ldexp(scaled.std(), exponent[0]))


def group_advantages(totals: np.ndarray, num_generations: int) -> np.ndarray:
  """GRPO's group-relative advantage (Shao et al. 2024, section 4.1.2, outcome supervision): each completion's total
  reward less its group's mean, over its group's standard deviation plus ADVANTAGE_EPS.

  A group is `num_generations` consecutive completions (one prompt's). The standard deviation is the sample one
  (ddof=1), as Tunix's grpo advantage estimator and TRL (torch.std) compute it; a group of equal rewards gets 0
  everywhere, so a prompt every completion answers alike teaches nothing, as GRPO means.

  Each group is computed divided by a power of two that brings it within [-1, 1] (ADVANTAGE_EPS divided too): the
  formula is unchanged, and the division is exact, so ordinary rewards give bit for bit what the plain formula
  gives, while finite rewards of any size (1e308, whose sum overflows) give finite advantages.

  totals [N] finite -> advantages [N] float32.
  """
  rewards = np.asarray(totals, np.float64)
  if num_generations < 2 or rewards.ndim != 1 or rewards.size % num_generations:
    raise ValueError(f"{rewards.shape} rewards do not form groups of num_generations={num_generations} (>= 2)")
  assert np.isfinite(rewards).all(), "total() refuses non-finite totals"
  groups = rewards.reshape(-1, num_generations)
  exponents = _power_of_two_scale(groups)
  scaled = np.ldexp(groups, -exponents)
  centred = scaled - scaled.mean(axis=1, keepdims=True)
  with np.errstate(over="ignore"):  # ADVANTAGE_EPS over 2^e of a tiny group: inf, and its advantages 0, as unscaled
    eps = np.ldexp(ADVANTAGE_EPS, -exponents)
  return (centred / (scaled.std(axis=1, ddof=1, keepdims=True) + eps)).reshape(-1).astype(np.float32)
