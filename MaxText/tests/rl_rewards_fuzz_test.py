"""A bounded fuzz of RL reward functions: hostile returns, hangs, exits, BaseExceptions, overflow, slow and failing
imports. Each case goes through what a step does with its rewards (rewards.load, score, total, group_advantages)
in this process and must end, within a time limit, in advantages equal to an exact reference, or in one line naming
the function (RewardError or ConfigError), or, for a KeyboardInterrupt, in the user's interrupt. A few cases run in
a real train.py (rl_test.py's data): one line on stderr and exit code 2, within a time limit.

References: the expected outcome of a generated return comes from each value's own tag (its float, or none for
what is not a finite real number) and Python's float arithmetic, and the advantages from exact rational arithmetic
(fractions), neither from NumPy's code under test.
"""

import decimal
import fractions
import importlib
import math
import os
import random
import sys
import threading
import time

import jax.numpy as jnp
import math_verify  # imported here: a case's limit is not for importing it
import numpy as np
import pytest

from MaxText.common_types import Config, ConfigError
from MaxText.rl import rewards
from MaxText.tests.helpers import FUZZ_PARTS, deadline, fuzz_part, run
from MaxText.tests.rl_test import _train, data  # noqa: F401 (a fixture)

SEED = 43
GENERATED = 90
N, G = 6, 3  # completions per call, and per group
LIMIT_S = 2.0  # reward_timeout_seconds of every case (a JAX array's first reading compiles a slice: well within)
CASE_S = 15  # the longest a case may take to end, hung ones included
OK, ERROR, INTERRUPT = "ok", "error", "interrupt"

# What a hanging function or import waits on: a new event for each case, set at its end, so no thread stays behind
# (each takes the event of its own case: `held = HELD` first).
HELD = threading.Event()


# ------------------------------------------------------------------------------------------ generated returns
class Rebel(float):
  """A float whose conversion raises: the user's code, run while its return is read."""

  def __float__(self):
    raise RuntimeError("no float for you")


POOL = [  # (a value a reward function may return for a completion, its float if it is a finite real number)
  (0, 0.0),
  (1, 1.0),
  (-2.5, -2.5),
  (True, 1.0),
  (np.float32(0.25), 0.25),
  (np.int64(-7), -7.0),
  (np.bool_(True), 1.0),
  (np.array(3.0), 3.0),
  (fractions.Fraction(1, 4), 0.25),
  (1e308, 1e308),
  (-1.7e308, -1.7e308),
  (5e-324, 5e-324),
  (2**1023, 2.0**1023),
  (10**400, None),
  (-(10**5000), None),
  (fractions.Fraction(10**400), None),
  (math.nan, None),
  (math.inf, None),
  (-math.inf, None),
  (np.float64("nan"), None),
  (np.float16(np.inf), None),
  (None, None),
  ("1", None),
  (b"1", None),
  (1j, None),
  (decimal.Decimal(1), None),
  ([1.0], None),
  (np.zeros(1), None),
  ({}, None),
  (Rebel(1.0), None),
]
SHAPES = ["list", "list", "list", "tuple", "ndarray", "generator", "set", "dict"]
WEIGHTS = [1.0, 2.0, -3.0, 0.5, 1e-300]


def _generated(i: int):
  """Case i: (what the function returns, its weight, the expected outcome)."""
  rng = random.Random(SEED * 1000 + i)
  length = rng.choice([N] * 6 + [N - 1, N + 1, 0])
  common = rng.random() < 0.8  # mostly ordinary numbers, so that many cases get as far as the advantages
  picks = [rng.choice(POOL[:13] if common else POOL) for _ in range(length)]
  values, floats = [v for v, _ in picks], [f for _, f in picks]
  shape, weight = rng.choice(SHAPES), rng.choice(WEIGHTS)
  if shape == "tuple":
    returned = tuple(values)
  elif shape == "ndarray":
    returned = np.empty(length, dtype=object)  # every value kept as it is
    for k, value in enumerate(values):
      returned[k] = value
  elif shape == "generator":
    returned = (v for v in values)
  elif shape == "set":
    returned = set(range(length))
  elif shape == "dict":
    returned = dict(enumerate(values))
  else:
    returned = values
  if shape in ("generator", "set", "dict") or length != N or None in floats:
    return returned, weight, (ERROR, None)
  totals = [weight * f for f in floats]  # Python's float arithmetic: an independent total
  if not all(math.isfinite(t) for t in totals):
    return returned, weight, (ERROR, "beyond float64's range")
  return returned, weight, (OK, totals)


def _exact_advantages(totals: list[float]) -> list[float]:
  """GRPO's advantage of each group, in rationals: (r - mean) / (sample std + 1e-4), the square root and the final
  division in float once scaled by the group's largest |r| (so that nothing overflows)."""
  out = []
  for start in range(0, len(totals), G):
    group = [fractions.Fraction(t) for t in totals[start : start + G]]
    largest = max(abs(r) for r in group)
    if largest == 0:
      out += [0.0] * G
      continue
    mean = sum(group) / G
    std = math.sqrt(float(sum(((r - mean) / largest) ** 2 for r in group) / (G - 1)))
    eps = float(fractions.Fraction(rewards.ADVANTAGE_EPS) / largest) if largest > 1e-300 else math.inf
    out += [float((r - mean) / largest) / (std + eps) for r in group]
  return out


# ------------------------------------------------------------------------------------------ behaviours
class Own(BaseException):
  pass


class Lying:
  """A length of N, an iteration of fewer (or endless) values."""

  def __init__(self, items):
    self.items = items

  def __len__(self):
    return N

  def __iter__(self):
    return iter(self.items)


class Exits:
  def __len__(self):
    raise SystemExit(0)


class Hangs:
  def __len__(self):
    HELD.wait(60)
    return N


class BadRepr:
  def __repr__(self):
    raise RuntimeError("no repr")


def _raise(error):
  def fn(prompts, completions, **columns):
    raise error

  return fn


def _return(value):
  return lambda prompts, completions, **columns: value


def _waits(prompts, completions, **columns):
  HELD.wait(60)
  return [0.0] * len(completions)


def _spins(prompts, completions, **columns):
  held = HELD
  while not held.is_set():
    pass
  return [0.0] * len(completions)


def _recurses(prompts, completions, **columns):
  return _recurses(prompts, completions, **columns)


def _jax_array(prompts, completions, **columns):  # made at the call: a device used at import fixes the tests' devices
  return jnp.arange(len(completions), dtype=jnp.float32)


def _mutates(prompts, completions, **columns):
  scores = [float(len(c)) for c in completions]
  completions.clear()  # the lists are the call's own copies: nothing else sees this
  columns["answer"].clear()
  return scores


def _math_verify_default_timeout(prompts, completions, **columns):
  return [
    float(bool(math_verify.verify(math_verify.parse(a), math_verify.parse(c))))
    for a, c in zip(columns["answer"], completions, strict=True)
  ]


LENGTHS = [float(len(c)) for c in ["a" * k for k in range(N)]]
NEAR_LIMIT = [1e308, -1e308, 0.0, 1.7e308, 1.7e308, -1.7e308]

BEHAVIOURS = [  # (id, the function, its weight, the expected outcome: (OK, totals) or (ERROR/INTERRUPT, a fragment))
  ("never returns", _waits, 1.0, (ERROR, f"did not return within {LIMIT_S:g} s (reward_timeout_seconds")),
  ("spins", _spins, 1.0, (ERROR, "did not return within")),
  ("sys.exit(0)", _raise(SystemExit(0)), 1.0, (ERROR, "raised SystemExit: 0; a reward function returns its scores")),
  ("sys.exit('text')", _raise(SystemExit("done")), 1.0, (ERROR, "raised SystemExit: done")),
  ("GeneratorExit", _raise(GeneratorExit()), 1.0, (ERROR, "raised GeneratorExit")),
  ("own BaseException", _raise(Own("x" * 10_000)), 1.0, (ERROR, "raised Own: xxx")),
  ("StopIteration", _raise(StopIteration()), 1.0, (ERROR, "raised StopIteration")),
  ("MemoryError", _raise(MemoryError()), 1.0, (ERROR, "raised MemoryError")),
  ("recursion", _recurses, 1.0, (ERROR, "raised RecursionError")),
  ("KeyboardInterrupt", _raise(KeyboardInterrupt()), 1.0, (INTERRUPT, None)),
  ("returns a generator", _return(x for x in [1.0] * N), 1.0, (ERROR, "returned generator")),
  ("returns an iterator", _return(iter([1.0] * N)), 1.0, (ERROR, "returned list_iterator")),
  ("length and iteration disagree", _return(Lying([1.0] * (N - 2))), 1.0, (ERROR, f"iteration gives {N - 2} values")),
  ("endless iteration", _return(Lying(iter(float, 1))), 1.0, (ERROR, "iteration gives more values")),
  ("__len__ exits", _return(Exits()), 1.0, (ERROR, "raised SystemExit")),
  ("__len__ hangs", _return(Hangs()), 1.0, (ERROR, "did not return within")),
  ("an unprintable value", _return([BadRepr()] * N), 1.0, (ERROR, "raised RuntimeError: no repr")),
  ("a million scores", _return([0.0] * 1_000_000), 1.0, (ERROR, "of length 1000000")),
  ("a 5000-digit int", _return([10**5000] * N), 1.0, (ERROR, "a non-finite value at index 0: <a int too large")),
  ("1e308 x 2", _return([1e308] * N), 2.0, (ERROR, "beyond float64's range, from reward function")),
  ("-1e308 x -2", _return([-1e308] * N), -2.0, (ERROR, "beyond float64's range")),
  ("1e308s normalise", _return(NEAR_LIMIT), 1.0, (OK, NEAR_LIMIT)),
  ("all nan", _return([math.nan] * N), 1.0, (ERROR, "a non-finite value at index 0: nan")),
  ("inf", _return([0.0] * (N - 1) + [math.inf]), 1.0, (ERROR, f"a non-finite value at index {N - 1}: inf")),
  ("mutates its arguments", _mutates, 1.0, (OK, LENGTHS)),
  ("a JAX array", _jax_array, 1.0, (OK, [float(i) for i in range(N)])),
  ("math-verify's default timeouts", _math_verify_default_timeout, 1.0, (ERROR, "parsing_timeout=None")),
]

IMPORTS = [  # (id, the module's source, the expected outcome)
  ("blocks", "from MaxText.tests.rl_rewards_fuzz_test import HELD\nHELD.wait(60)\n", (ERROR, "did not finish within")),
  ("exits", "import sys\nsys.exit(0)\n", (ERROR, "does not import (SystemExit: 0)")),
  ("own BaseException", "class Own(BaseException): pass\nraise Own('at import')\n", (ERROR, "(Own: at import)")),
  ("syntax", "def fn(:\n", (ERROR, "does not import (SyntaxError")),
  ("KeyboardInterrupt", "raise KeyboardInterrupt\n", (INTERRUPT, None)),
  ("__getattr__ raises", "def __getattr__(name):\n  raise RuntimeError(name)\n", (ERROR, "reading 'fn' of")),
  ("not callable", "fn = None\n", (ERROR, "is a NoneType, not a function")),
  ("signature raises", "class F:\n  @property\n  def __signature__(self):\n    raise RuntimeError('sig')\n"
   "  def __call__(self, prompts, completions, **columns):\n    return [1.0] * len(completions)\nfn = F()\n",
   (OK, [1.0] * N)),
]  # fmt: skip


def _cases() -> list[tuple]:
  """Every case: ("generated", i) | ("behaviour", i) | ("import", i)."""
  return (
    [("generated", i) for i in range(GENERATED)]
    + [("behaviour", i) for i in range(len(BEHAVIOURS))]
    + [("import", i) for i in range(len(IMPORTS))]
  )


def _config(*names) -> Config:
  return Config({
    "use_rl": True, "num_generations": G, "reward_functions": names, "reward_weights": (), "reward_format_regex": "",
    "reward_timeout_seconds": LIMIT_S,
  })  # fmt: skip


def _steps_rewards(loaded: list[rewards.Reward]) -> np.ndarray:
  """What a step does with its rewards: score, total, advantages."""
  completions = ["a" * k for k in range(N)]
  scores = rewards.score(loaded, ["p"] * N, completions, {"answer": ["1"] * N})
  return rewards.group_advantages(rewards.total(loaded, scores), G)


def _outcome(kind: str, i: int, tmp_path) -> tuple[tuple, str, object]:
  """(expected, the function's name, what happened: advantages, or the exception)."""
  if kind == "import":
    _, source, expected = IMPORTS[i]
    module = f"fuzzed_rewards_{i}"
    (tmp_path / f"{module}.py").write_text(source)
    importlib.invalidate_caches()
    name = f"{module}:fn"
    try:
      return expected, name, _steps_rewards(rewards.load(_config(name)))
    except (ConfigError, KeyboardInterrupt) as e:
      return expected, name, e
  if kind == "generated":
    returned, weight, expected = _generated(i)
    fn = _return(returned)
  else:
    _, fn, weight, expected = BEHAVIOURS[i]
  name = f"fuzz_mod:{kind}_{i}"
  reward = rewards.Reward(name, fn, weight, timeout=LIMIT_S)
  try:
    return expected, name, _steps_rewards([reward])
  except (ConfigError, KeyboardInterrupt) as e:
    return expected, name, e


def _judge(expected: tuple, name: str, got) -> str | None:
  """What is wrong with `got`, or None."""
  want, detail = expected
  if want == INTERRUPT:
    return None if isinstance(got, KeyboardInterrupt) else f"expected KeyboardInterrupt, got {got!r}"
  if want == ERROR:
    if not isinstance(got, ConfigError):
      return f"expected an error, got {type(got).__name__} {got!r}"[:300]
    message = str(got)
    if "\n" in message or len(message) > 700 or name not in message:
      return f"not one line naming {name}: {message[:300]!r}"
    if detail is not None and detail not in message:
      return f"{detail!r} not in {message!r}"
    return None
  if isinstance(got, BaseException):
    return f"expected advantages, got {type(got).__name__}: {got}"[:300]
  want_advantages = _exact_advantages(detail)
  if not np.allclose(got, want_advantages, rtol=1e-5, atol=1e-6):  # float32's rounding
    return f"advantages {got} != {want_advantages}"
  return None


@pytest.fixture
def modules(tmp_path, monkeypatch):
  """A folder on sys.path for the fuzzed modules, forgotten at the end."""
  monkeypatch.syspath_prepend(str(tmp_path))
  yield tmp_path
  for module in [m for m in sys.modules if m.startswith("fuzzed_rewards_")]:
    del sys.modules[module]


@pytest.mark.parametrize("part", FUZZ_PARTS)
def test_fuzzed_rewards_end_in_advantages_or_one_line_naming_the_function(part, modules):
  failures = []
  cases = fuzz_part(_cases(), part)
  global HELD
  for _, (kind, i) in cases:
    HELD = threading.Event()
    started = time.monotonic()
    try:
      with deadline(CASE_S):
        expected, name, got = _outcome(kind, i, modules)
    finally:
      HELD.set()
    seconds = time.monotonic() - started
    problem = _judge(expected, name, got)
    if seconds > LIMIT_S + 3:
      problem = f"took {seconds:.1f} s (reward_timeout_seconds={LIMIT_S})"
    if problem:
      failures.append(f"{kind} {i}: {problem}")
  assert not failures, "\n".join(failures)
  assert len(cases) > 10


def test_the_generated_cases_cover_every_outcome():
  """The generator is not all errors: some cases get to the advantages, some overflow, some are refused earlier."""
  outcomes = [_generated(i)[2] for i in range(GENERATED)]
  assert sum(o[0] == OK for o in outcomes) >= 10
  assert sum(o[1] == "beyond float64's range" for o in outcomes) >= 1
  assert sum(o == (ERROR, None) for o in outcomes) >= 8


# ------------------------------------------------------------------------------------------ in train.py
HOSTILE = """
import os, sys, threading

if os.environ.get("HOSTILE_IMPORT_BLOCKS"):
  threading.Event().wait()

def hangs(prompts, completions, **columns):
  threading.Event().wait()

def exits(prompts, completions, **columns):
  sys.exit(0)

def huge(prompts, completions, **columns):
  return [1e308] * len(completions)

calls = 0

def interrupts(prompts, completions, **columns):
  global calls
  calls += 1
  if calls == 3:
    raise KeyboardInterrupt
  return [0.0] * len(completions)
"""

TRAIN_CASES = [  # (id, reward function, extra keys, environment, exit code, the error line's fragments)
  ("hangs", "hangs", ["reward_timeout_seconds=3"], {}, 2,
   ["reward function hostile_rewards:hangs did not return within 3 s (reward_timeout_seconds=3)"]),
  ("exits", "exits", [], {}, 2, ["reward function hostile_rewards:exits raised SystemExit: 0"]),
  ("overflows", "huge", ["reward_weights=[2.0]"], {}, 2,
   ["is 2 x 1e+308 = inf", "from reward function hostile_rewards:huge"]),
  ("import blocks", "hangs", ["reward_timeout_seconds=3"], {"HOSTILE_IMPORT_BLOCKS": "1"}, 2,
   ["importing module 'hostile_rewards' did not finish within 3 s (reward_timeout_seconds=3)"]),
  # The user's interrupt, raised by the function: the run's own (save, exit 1), not a reward error.
  ("KeyboardInterrupt", "interrupts", ["steps=4", "enable_checkpointing=true"], {}, 1,
   ["error: interrupted (SIGINT) while waiting for the data of step 2; checkpoint 2 is saved"]),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("case", TRAIN_CASES, ids=[c[0] for c in TRAIN_CASES])
def test_hostile_rewards_end_train_py_in_one_line_and_the_right_exit_code(case, data, tmp_path):  # noqa: F811
  """train.py with a reward that hangs, exits, overflows, or a module that blocks at import: one line on stderr
  naming it, exit 2, within a time limit (the hung thread does not hold the exit), and the module it imported
  printed with its file; a KeyboardInterrupt from the function: the interrupt's line, the steps done saved, exit 1."""
  case_id, function, keys, environment, code, fragments = case
  (tmp_path / "hostile_rewards.py").write_text(HOSTILE)
  args, env = _train(data, tmp_path, "run_name=r", "steps=2", f"reward_functions=['hostile_rewards:{function}']", *keys)
  env = {**env, **environment, "PYTHONPATH": f"{tmp_path}{os.pathsep}{env.get('PYTHONPATH', '')}"}
  started = time.monotonic()
  proc = run(args, env, timeout=240)
  assert proc.returncode == code, proc.stderr[-3000:]
  assert proc.stderr.count("\n") == 1, proc.stderr[-3000:]
  for fragment in fragments:
    assert fragment in proc.stderr, proc.stderr
  assert time.monotonic() - started < 200
  if case_id != "import blocks":
    assert f"reward_functions imported and run code from: hostile_rewards ({tmp_path / 'hostile_rewards.py'})" in (
      proc.stdout
    )
