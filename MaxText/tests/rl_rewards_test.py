"""MaxText/rl/rewards.py: the built-in rewards, loading "module:function", the one-line errors, the weighted total
and GRPO's group advantages against a float64 reference written out here."""

import math
import sys
import threading

import numpy as np
import pytest

from MaxText.common_types import Config, ConfigError
from MaxText.rl import rewards

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
  ],
)
def test_check_refuses_in_one_line_naming_the_key(changes, fragments):
  values = {**_config().as_dict(), **{k: list(v) if isinstance(v, tuple) else v for k, v in changes.items()}}
  message = _one_line_error(ConfigError, rewards.check, values)
  for fragment in fragments:
    assert fragment in message, message


def test_check_accepts_a_valid_config_and_rewards_off():
  rewards.check({**_config().as_dict(), "reward_functions": ["exact_match", "a.b:c.d"], "reward_weights": [1, 0.5]})
  rewards.check({**_config().as_dict(), "use_rl": False, "reward_functions": [], "num_generations": 1})


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
