"""MaxText/rl/rewards.py: the built-in rewards, loading "module:function", the one-line errors, the weighted total
and GRPO's group advantages against a float64 reference written out here."""

import fractions
import math
import os
import signal
import sys
import threading
import time

import numpy as np
import pytest

from MaxText import cli
from MaxText.common_types import Config, ConfigError
from MaxText.rl import rewards
from MaxText.sections.reinforcement import check_rewards
from MaxText.tests.helpers import deadline, run

HERE = "MaxText.tests.rl_rewards_test"
NOT_CALLABLE = 3


def long_reward(prompts, completions, **columns):
  """A reward of the tests' own: 1 for a completion longer than its prompt, plus the record's bonus."""
  return [float(len(c) > len(p)) + b for p, c, b in zip(prompts, completions, columns["bonus"], strict=True)]


class Holder:
  @staticmethod
  def nested(prompts, completions, **columns):
    del prompts, columns
    return np.arange(len(completions), dtype=np.float32)


def raising(prompts, completions, **columns):
  raise TypeError("bad input\non two lines " + "x" * 1000)


def no_kwargs(prompt, completion):
  return [0.0]


def returns(value):
  """A reward function returning `value`, whatever the inputs."""
  return lambda prompts, completions, **columns: value


def _config(**changes) -> Config:
  values = {
    "use_rl": True,
    "num_generations": 2,
    "reward_functions": ("exact_match",),
    "reward_weights": (),
    "reward_format_regex": "",
    "reward_timeout_seconds": 600.0,
  }
  return Config({**values, **changes})


def _score(fn, completions, name="f", **columns):
  return rewards.score([rewards.Reward(name, fn, 1.0)], ["p"] * len(completions), completions, columns)


def _one_line_error(error_type, fn, *args, **kwargs) -> str:
  with pytest.raises(error_type) as info:
    fn(*args, **kwargs)
  message = str(info.value)
  assert "\n" not in message and len(message) < 600, message
  return message


# ------------------------------------------------------------------------------------------ built-ins
def test_exact_match_strips_whitespace_and_compares_str_of_answer():
  completions = ["  42\n", "42", "4 2", "42.0", "\tyes ", "no"]
  answers = [42, " 42 ", "42", 42, "yes", "yes"]
  got = _score(rewards.exact_match, completions, answer=answers)
  np.testing.assert_array_equal(got[:, 0], [1, 1, 0, 0, 1, 0])


def test_format_matches_the_whole_completion_across_lines():
  [fmt] = rewards.load(
    _config(reward_functions=("format",), reward_format_regex=r"<think>.*</think>\s*<answer>\d+</answer>")
  )
  completions = [
    "<think>step one\nstep two</think>\n<answer>7</answer>",  # `.` crosses the newline (DOTALL)
    "<think>x</think><answer>7</answer> trailing",  # a match must cover the whole completion
    "preamble <think>x</think><answer>7</answer>",
    "<think>x</think><answer>seven</answer>",
  ]
  got = rewards.score([fmt], [""] * 4, completions, {})
  np.testing.assert_array_equal(got[:, 0], [1, 0, 0, 0])


MATH_CASES = [  # (gold, completion, reward)
  ("1/2", "0.5", 1),
  ("1/2", "\\frac{1}{2}", 1),
  ("0.5", "The answer is $\\frac{1}{2}$.", 1),
  ("\\frac{1}{2}", "so it is \\boxed{0.5}", 1),
  ("42", "Adding them gives 40 + 2 = 42", 1),
  ("1/2", "0.6", 0),
  ("42", "41", 0),
  ("42", "I have no idea", 0),
  ("42", "$\\frac{", 0),
  ("42", "", 0),
  ("}{not math", "42", 0),
]


def test_math_finds_equivalent_forms_and_scores_unparsable_text_zero():
  [math_reward] = rewards.load(_config(reward_functions=("math",)))
  golds, completions, expected = zip(*MATH_CASES, strict=True)
  got = rewards.score([math_reward], [""] * len(golds), list(completions), {"answer": list(golds)})
  np.testing.assert_array_equal(got[:, 0], expected)


def test_math_works_off_the_main_thread():
  """math-verify's timeouts use SIGALRM, which only the main thread may set; the reward must still work elsewhere."""
  [math_reward] = rewards.load(_config(reward_functions=("math",)))
  golds, completions, expected = zip(*MATH_CASES, strict=True)
  results = {}

  def run():
    try:
      results["scores"] = rewards.score([math_reward], [""] * len(golds), list(completions), {"answer": list(golds)})
    except Exception as e:  # noqa: BLE001 (reported to the main thread below)
      results["error"] = e

  worker = threading.Thread(target=run)
  worker.start()
  worker.join()
  assert "error" not in results, results.get("error")
  np.testing.assert_array_equal(results["scores"][:, 0], expected)


def test_builtin_without_its_column_names_the_function_the_column_and_the_columns():
  for name in ("exact_match", "math"):
    [reward] = rewards.load(_config(reward_functions=(name,)))
    message = _one_line_error(rewards.RewardError, rewards.score, [reward], ["p"], ["c"], {"question": ["q"], "id": [1]})
    assert f"reward function {name} needs the column 'answer'" in message
    assert "['id', 'question']" in message


def test_math_without_math_verify_is_a_config_error(monkeypatch):
  monkeypatch.setitem(sys.modules, "math_verify", None)  # import math_verify now raises ImportError
  message = _one_line_error(ConfigError, rewards.load, _config(reward_functions=("math",)))
  assert "'math'" in message and "pip install math-verify" in message


# ------------------------------------------------------------------------------------------ loading
def test_load_module_function_with_weights_and_dotted_attribute():
  loaded = rewards.load(
    _config(reward_functions=("exact_match", f"{HERE}:long_reward", f"{HERE}:Holder.nested"), reward_weights=(2, -0.5, 3))
  )
  assert [r.name for r in loaded] == ["exact_match", f"{HERE}:long_reward", f"{HERE}:Holder.nested"]
  assert loaded[1].fn is long_reward and loaded[2].fn is Holder.nested
  assert [r.weight for r in loaded] == [2.0, -0.5, 3.0]

  prompts = ["ab", "ab", "abcdef", "abcdef"]
  completions = ["yes", "x", "yes", "no"]
  columns = {"answer": ["yes", "yes", "no", "no"], "bonus": [0.25, 0.0, 0.0, 1.0]}
  scores = rewards.score(loaded, prompts, completions, columns)
  assert scores.shape == (4, 3) and scores.dtype == np.float64
  # Each column by hand: exact match; (len(completion) > len(prompt)) + bonus; the index.
  expected = np.array([[1, 1.25, 0], [0, 0, 1], [0, 0, 2], [1, 1, 3]], np.float64)
  np.testing.assert_array_equal(scores, expected)
  np.testing.assert_array_equal(rewards.total(loaded, scores), [2 - 0.625, 3, 6, 2 - 0.5 + 9])


def test_empty_weights_weigh_each_one():
  loaded = rewards.load(_config(reward_functions=("exact_match", f"{HERE}:Holder.nested")))
  assert [r.weight for r in loaded] == [1.0, 1.0]
  scores = np.array([[1.0, 2.0], [0.0, 5.0]])
  np.testing.assert_array_equal(rewards.total(loaded, scores), [3.0, 5.0])


def test_reserved_column_names_are_not_passed():
  seen = {}

  def spy(prompts, completions, **columns):
    seen.update(prompts=prompts, completions=completions, columns=columns)
    return [0.0] * len(completions)

  rewards.score([rewards.Reward("spy", spy, 1.0)], ["p"], ["c"], {"prompts": ["x"], "completions": ["y"], "answer": [1]})
  assert seen == {"prompts": ["p"], "completions": ["c"], "columns": {"answer": [1]}}


@pytest.mark.parametrize(
  "name, fragments",
  [
    ("no_such_module_for_rewards:fn", ["module 'no_such_module_for_rewards' does not import", "ModuleNotFoundError"]),
    (f"{HERE}:missing", [f"module '{HERE}'", "has no 'missing'"]),
    (f"{HERE}:Holder.missing", ["has no 'Holder.missing'"]),
    (f"{HERE}:NOT_CALLABLE", [f"{HERE}.NOT_CALLABLE is a int, not a function"]),
    (f"{HERE}:no_kwargs", ["cannot take prompts= and completions="]),
  ],
)
def test_load_errors_are_one_line_naming_the_function(name, fragments):
  message = _one_line_error(ConfigError, rewards.load, _config(reward_functions=(name,)))
  assert f"reward_functions has {name!r}" in message
  for fragment in fragments:
    assert fragment in message, message


def test_a_module_that_raises_on_import_is_named_with_its_error(tmp_path, monkeypatch):
  (tmp_path / "broken_rewards_module.py").write_text("raise RuntimeError('no GPU\\nhere')\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  message = _one_line_error(ConfigError, rewards.load, _config(reward_functions=("broken_rewards_module:fn",)))
  assert "module 'broken_rewards_module' does not import (RuntimeError: no GPU here)" in message


# ------------------------------------------------------------------------------------------ check
@pytest.mark.parametrize(
  "changes, fragments",
  [
    ({"reward_functions": ()}, ["use_rl=true with reward_functions=[]"]),
    ({"num_generations": 1}, ["num_generations=1", ">= 2"]),
    ({"reward_functions": ("exact-match",)}, ["'exact-match'", "did you mean 'exact_match'?", "module:function"]),
    ({"reward_functions": ("my module:fn",)}, ["'my module:fn'", "neither a built-in"]),
    ({"reward_functions": ("mod:",)}, ["'mod:'", "neither a built-in"]),
    ({"reward_functions": ("math", "math")}, ["lists 'math' twice"]),
    ({"reward_weights": (1.0, 2.0)}, ["reward_weights=[1.0, 2.0] has 2 weights for 1 reward_functions"]),
    ({"reward_weights": (math.nan,)}, ["nan is not a finite number"]),
    ({"reward_functions": ("format",)}, ["reward_format_regex=''", "'format'"]),
    (
      {"reward_functions": ("format",), "reward_format_regex": "(a"},
      ["reward_format_regex='(a' does not compile", "re.error"],
    ),
    ({"reward_timeout_seconds": 0.0}, ["reward_timeout_seconds=0.0", "> 0"]),
    ({"reward_timeout_seconds": -5}, ["reward_timeout_seconds=-5"]),
    ({"reward_timeout_seconds": math.inf}, ["reward_timeout_seconds=inf"]),
    ({"reward_timeout_seconds": math.nan}, ["reward_timeout_seconds=nan"]),
    ({"reward_timeout_seconds": True}, ["reward_timeout_seconds=True"]),
  ],
)
def test_check_refuses_in_one_line_naming_the_key(changes, fragments):
  values = {**_config().as_dict(), **{k: list(v) if isinstance(v, tuple) else v for k, v in changes.items()}}
  message = _one_line_error(ConfigError, check_rewards, values, "use_rl=true")
  for fragment in fragments:
    assert fragment in message, message


def test_check_accepts_a_valid_config_and_rewards_off():
  check_rewards(
    {**_config().as_dict(), "reward_functions": ["exact_match", "a.b:c.d"], "reward_weights": [1, 0.5]}, "use_rl=true"
  )
  check_rewards({**_config().as_dict(), "reward_functions": [], "num_generations": 1}, None)


# ------------------------------------------------------------------------------------------ score errors
def test_a_function_that_raises_is_one_line_naming_it():
  message = _one_line_error(rewards.RewardError, _score, raising, ["c"], name="my_mod:raising")
  assert message.startswith("reward function my_mod:raising raised TypeError: bad input on two lines xxx")
  shown_length = len("bad input on two lines " + "x" * 1000)  # the newline became a space
  assert message.endswith(f"... ({shown_length} characters)")  # cut, saying how long it was


@pytest.mark.parametrize(
  "returned, fragments",
  [
    ([1.0], ["returned list of length 1", "expected a sequence of 2 numbers"]),
    (np.zeros(3), ["returned ndarray of length 3"]),
    (1.0, ["returned float 1.0", "expected a sequence of 2 numbers"]),
    (None, ["returned NoneType None"]),
    ("10", ["returned str '10'"]),
    ({"a": 1, "b": 2}, ["returned dict {'a': 1, 'b': 2}"]),
    ([1.0, "1"], ["returned a non-number at index 1: '1'"]),
    ([None, 1.0], ["returned a non-number at index 0: None"]),
    ([1.0, math.nan], ["returned a non-finite value at index 1: nan", "all finite"]),
    ((math.inf, 0), ["returned a non-finite value at index 0: inf"]),
    ([0, 10**400], ["returned a non-finite value at index 1"]),
    (np.zeros((2, 1)), ["returned a non-number at index 0: array([0.])"]),
  ],
)
def test_wrong_returns_are_one_line_naming_the_function_and_what_it_returned(returned, fragments):
  message = _one_line_error(rewards.RewardError, _score, returns(returned), ["a", "b"], name="my_mod:bad")
  assert message.startswith("reward function my_mod:bad returned ")
  for fragment in fragments:
    assert fragment in message, message


def test_numbers_of_every_kind_are_accepted():
  returned = [True, 2, np.float32(0.5), np.int64(-3), np.bool_(False), np.array(1.5)]
  got = _score(returns(returned), list("abcdef"))
  np.testing.assert_array_equal(got[:, 0], [1, 2, 0.5, -3, 0, 1.5])


# ------------------------------------------------------------------------------------------ advantages
def _reference_advantages(totals, group):
  """GRPO's outcome advantage written out per group: (r - mean) / (sample std + 1e-4), in float64."""
  out = []
  for start in range(0, len(totals), group):
    members = [float(r) for r in totals[start : start + group]]
    mean = sum(members) / group
    std = math.sqrt(sum((r - mean) ** 2 for r in members) / (group - 1))
    out += [(r - mean) / (std + 1e-4) for r in members]
  return np.array(out)


def test_group_advantages_equal_the_reference():
  rng = np.random.default_rng(0)
  totals = np.concatenate([rng.normal(size=8), [1.0, 0.0, 0.0, 0.0], [0.5] * 4, rng.integers(0, 3, 4)])
  got = rewards.group_advantages(totals, 4)
  assert got.dtype == np.float32 and got.shape == (20,)
  np.testing.assert_allclose(got, _reference_advantages(totals, 4), rtol=1e-6, atol=1e-6)  # float32's rounding
  np.testing.assert_array_equal(got[12:16], 0.0)  # a group of equal rewards teaches nothing
  # [1, 0, 0, 0] by hand: mean 1/4, sample variance (9/16 + 3/16) / 3 = 1/4, so std 1/2.
  np.testing.assert_allclose(got[8:12], np.array([0.75, -0.25, -0.25, -0.25]) / (0.5 + 1e-4), rtol=1e-6)


def test_group_advantages_refuse_a_partial_group():
  with pytest.raises(ValueError, match="num_generations=4"):
    rewards.group_advantages(np.zeros(6), 4)
  with pytest.raises(ValueError, match="num_generations=1"):
    rewards.group_advantages(np.zeros(6), 1)


def test_advantages_of_rewards_near_float64_s_limit_are_finite_and_exact():
  """1e308s overflow a plain group mean (inf - inf: NaN advantages); scaled by a power of two they normalise like
  any rewards. Reference: the formula in exact rational arithmetic (the square root, and ADVANTAGE_EPS, which is
  nothing beside a std of 1e308, aside)."""
  totals = np.array([1e308, -1e308, 1e308, 0.0, 1.7e308, 1.7e308, 1.7e308, -1.7e308, 5e-324, 0.0, 0.0, 0.0])
  got = rewards.group_advantages(totals, 4)
  assert np.isfinite(got).all(), got
  for start in (0, 4):
    members = [fractions.Fraction(float(r)) for r in totals[start : start + 4]]
    mean, largest = sum(members) / 4, max(abs(m) for m in members)
    std_over_largest = math.sqrt(float(sum((r - mean) ** 2 for r in members) / 3 / largest**2))  # within range
    want = [float((r - mean) / largest) / std_over_largest for r in members]
    np.testing.assert_allclose(got[start : start + 4], want, rtol=1e-6)  # float32's rounding
  # 5e-324 (the least subnormal) against zeros: its std is far below ADVANTAGE_EPS, so advantages ~5e-320 -> 0.
  np.testing.assert_array_equal(got[8:], 0.0)
  assert rewards.mean_and_std(np.array([1e308, 1e308, 1e308])) == (1e308, 0.0)
  mean, std = rewards.mean_and_std(np.array([1.5e308, -0.5e308]))
  assert mean == pytest.approx(0.5e308, rel=1e-15) and std == pytest.approx(1e308, rel=1e-15)


def _loaded(*pairs):
  return [rewards.Reward(name, returns(None), weight) for name, weight in pairs]


def test_a_total_beyond_float64_names_the_rewards_that_made_it():
  """Finite scores whose weighted sum overflows: one line naming the function(s), not an inf total."""
  loaded = _loaded(("mod:big", 2.0), ("mod:small", 1.0))
  message = _one_line_error(rewards.RewardError, rewards.total, loaded, np.array([[1.0, 0.0], [1e308, 3.0]]))
  assert "completion 1 is 2 x 1e+308 + 1 x 3 = inf" in message
  assert "from reward function mod:big (1 of 2 completions)" in message
  loaded = _loaded(("mod:a", 1.0), ("mod:b", 1.0), ("mod:c", 1.0))
  message = _one_line_error(rewards.RewardError, rewards.total, loaded, np.array([[1e308, 1e308, 0.0]]))
  assert "from reward functions mod:a, mod:b (1 of 1 completions)" in message  # each finite, their sum not
  loaded = _loaded(("mod:a", 1.0), ("mod:b", -1.0))
  message = _one_line_error(rewards.RewardError, rewards.total, loaded, np.array([[1e308, -1e308], [1.0, 1.0]]))
  assert "= inf" in message and "mod:a, mod:b" in message


# ------------------------------------------------------------------------------------------ hangs, exits, signals
@pytest.fixture
def held():
  """An event a hanging reward waits on, set at the test's end so its thread ends too."""
  event = threading.Event()
  yield event
  event.set()


def _waits(event: threading.Event):
  def stuck(prompts, completions, **columns):
    event.wait(60)
    return [0.0] * len(completions)

  return stuck


def test_a_function_that_never_returns_stops_at_the_time_limit_naming_it_and_the_key(held):
  reward = rewards.Reward("my_mod:stuck", _waits(held), 1.0, timeout=0.3)
  started = time.monotonic()
  with deadline(20):
    message = _one_line_error(rewards.RewardError, rewards.score, [reward], ["p"], ["c"], {})
  assert time.monotonic() - started < 5
  assert message == (
    "reward function my_mod:stuck did not return within 0.3 s (reward_timeout_seconds=0.3); make it return sooner, "
    "or raise reward_timeout_seconds if it needs longer"
  )


def test_the_time_limit_is_per_call_and_a_slow_function_within_it_scores():
  def slow(prompts, completions, **columns):
    time.sleep(0.2)
    return [float(len(c)) for c in completions]

  reward = rewards.Reward("my_mod:slow", slow, 1.0, timeout=5.0)
  np.testing.assert_array_equal(rewards.score([reward, reward], ["p", "p"], ["ab", "c"], {}), [[2, 2], [1, 1]])


class OwnBaseException(BaseException):
  pass


def _raiser(error: BaseException):
  def fn(prompts, completions, **columns):
    raise error

  return fn


@pytest.mark.parametrize(
  "error, shown_as",
  [
    (SystemExit(0), "raised SystemExit: 0; a reward function returns its scores, it cannot end the run"),
    (SystemExit(), "raised SystemExit; a reward function returns its scores"),
    (SystemExit("bye"), "raised SystemExit: bye;"),
    (GeneratorExit(), "raised GeneratorExit"),
    (OwnBaseException("mine"), "raised OwnBaseException: mine"),
  ],
)
def test_sys_exit_and_other_base_exceptions_are_reward_errors_naming_the_function(error, shown_as):
  message = _one_line_error(rewards.RewardError, _score, _raiser(error), ["c"], name="my_mod:quits")
  assert message.startswith(f"reward function my_mod:quits {shown_as}"), message


def test_an_exception_whose_message_fails_is_still_one_line():
  class Unprintable(Exception):
    def __str__(self):
      raise RuntimeError("no")

  message = _one_line_error(rewards.RewardError, _score, _raiser(Unprintable()), ["c"], name="m:f")
  assert message == "reward function m:f raised Unprintable: (its message cannot be shown)"


def test_keyboard_interrupt_from_a_reward_stays_the_user_s_interrupt():
  with pytest.raises(KeyboardInterrupt):
    _score(_raiser(KeyboardInterrupt()), ["c"])


def test_sigterm_during_a_reward_call_is_the_loop_s_signal_not_the_reward_s_error(held):
  """The training loop waits for rewards within StopRequest.interrupting(): a SIGTERM must end the wait with its own
  exception (train.py saves and exits 1), not be raised inside the user's function and reported as its error."""
  reward = rewards.Reward("my_mod:stuck", _waits(held), 1.0)
  stop = cli.StopRequest()
  timer = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM))
  try:
    with deadline(20), pytest.raises(cli.StopRequest.Interrupted), stop.interrupting():
      timer.start()
      rewards.score([reward], ["p"], ["c"], {})
  finally:
    timer.cancel()
    stop.restore()
  assert stop.signal_name == "SIGTERM"


HELD_IMPORT = threading.Event()


def test_a_module_that_blocks_at_import_stops_at_the_time_limit(tmp_path, monkeypatch):
  (tmp_path / "blocking_rewards_module.py").write_text(
    "from MaxText.tests.rl_rewards_test import HELD_IMPORT\nHELD_IMPORT.wait(60)\n\ndef fn(prompts, completions):\n"
    "  return [0.0] * len(completions)\n"
  )
  monkeypatch.syspath_prepend(str(tmp_path))
  config = _config(reward_functions=("blocking_rewards_module:fn",), reward_timeout_seconds=0.5)
  try:
    with deadline(20):
      message = _one_line_error(ConfigError, rewards.load, config)
  finally:
    HELD_IMPORT.set()
  assert message == (
    "reward_functions has 'blocking_rewards_module:fn': importing module 'blocking_rewards_module' did not finish "
    "within 0.5 s (reward_timeout_seconds=0.5); a reward module must not block at import: fix it, or raise "
    "reward_timeout_seconds if its import needs longer"
  )


@pytest.mark.parametrize(
  "source, shown_as", [("import sys\nsys.exit(0)\n", "SystemExit: 0"), ("exit(3)\n", "SystemExit: 3")]
)
def test_a_module_that_exits_at_import_is_named_with_its_exit(tmp_path, monkeypatch, source, shown_as):
  name = f"exiting_rewards_module_{len(source)}"
  (tmp_path / f"{name}.py").write_text(source)
  monkeypatch.syspath_prepend(str(tmp_path))
  message = _one_line_error(ConfigError, rewards.load, _config(reward_functions=(f"{name}:fn",)))
  assert f"module {name!r} does not import ({shown_as})" in message


def test_the_modules_imported_are_named_with_their_files(tmp_path, monkeypatch):
  (tmp_path / "named_rewards_module.py").write_text("def fn(prompts, completions):\n  return [0.0] * len(completions)\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  loaded = rewards.load(_config(reward_functions=("exact_match", "named_rewards_module:fn", f"{HERE}:long_reward")))
  assert [r.builtin for r in loaded] == [True, False, False]
  assert rewards.imported(loaded) == (
    f"reward_functions imported and run code from: named_rewards_module ({tmp_path / 'named_rewards_module.py'}), "
    f"{HERE} ({os.path.abspath(__file__)})"
  )
  assert rewards.imported(rewards.load(_config(reward_functions=("exact_match",)))) is None


HUNG_EXIT = """
import sys, threading, time
from MaxText.rl import rewards

def stuck(prompts, completions, **columns):
  if {spin}:
    while True:
      pass
  threading.Event().wait()

try:
  rewards.score([rewards.Reward("m:stuck", stuck, 1.0, timeout=0.5)], ["p"], ["c"], {{}})
except rewards.RewardError as e:
  print(e, flush=True)
  sys.exit(2)
"""


@pytest.mark.parametrize("spin", [False, True])
def test_a_process_whose_reward_hangs_still_exits(spin):
  """The hung call's thread is a daemon: interpreter exit does not wait for it, whether it blocks or spins."""
  started = time.monotonic()
  proc = run([sys.executable, "-c", HUNG_EXIT.format(spin=spin)], os.environ, timeout=60)
  assert proc.returncode == 2, proc.stderr
  assert proc.stdout.startswith("reward function m:stuck did not return within 0.5 s"), proc.stdout
  assert time.monotonic() - started < 30
