"""Fuzzed command lines: a few hundred bad configurations, drawn with a fixed seed from the mistakes users make
(every case of issue 15's probe, plus random mutations of a valid command line), each of which must end train.py
with exit code 2 and one line on stderr, no traceback, and nothing written."""

import collections
import os
import random
import shutil

import yaml

from MaxText import pyconfig, train
from MaxText.tests.helpers import BASE_YML, overrides

CASES = 300
SEED = 15

# The probe's cases (issue 15), as command-line overrides; {tmp} is the test's output folder.
PROBED = [
  ["run_name=../escape"],
  ["run_name=/abs/escape"],
  ["run_name=."],
  ["run_name=.."],
  ["run_name=a\x01b"],
  ["base_output_directory={tmp}/a_file"],
  ["metrics_file={tmp}/a_folder"],
  ["metrics_file={tmp}/a_file/metrics.jsonl"],
  ["max_num_checkpoints_to_keep=-1"],
  ["vocab_size=2147483648"],
  [f"init_weights_seed={2**70}"],
  ["hardware=gpu"],
  ["hardware=tpu"],
  ["steps=1e3"],
  ["learning_rate=-1"],
  ["base_emb_dim=40000000"],
  ["load_parameters_path={tmp}/no_such_checkpoint"],
  ["load_full_state_path={tmp}/a_folder"],
  ["dataset_type=grain", "grain_train_files={tmp}/missing*.array_record"],
  ["ici_tensor_parallelism=3"],
  ["ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"],
  ["dcn_data_parallelism=2"],
  ["ici_pipeline_parallelism=2", "num_pipeline_microbatches=3"],
  ["steps"],
  ["=3"],
  ["steps=3", "steps=4x"],
  ["model_name=no_such_model"],
  ["base_num_query_heads=3", "base_num_kv_heads=2"],
  ["tokenizer_path=gs://bucket/tokenizer.model"],
]

_NOT_NUMBERS = ["abc", "[1, 2]", "{a: 1}", "1..2", "0x", "--3", "one"]
_NOT_INTS = [*_NOT_NUMBERS, "1.5", "1e3", "2.0"]
_NOT_BOOLS = ["maybe", "2", "[]", "truee", "0.5"]
_NOT_POSITIVE = {
  "steps": ["0", "-1"],
  "per_device_batch_size": ["0", "-1", "-0.5"],
  "max_target_length": ["0", "-8"],
  "base_emb_dim": ["0", "-64"],
  "base_num_decoder_layers": ["0", "-1"],
  "base_num_query_heads": ["0"],
  "base_num_kv_heads": ["0"],
  "base_mlp_dim": ["0"],
  "head_dim": ["0", "-2"],
  "vocab_size": ["0", "-1", "2147483648", "99999999999"],
  "learning_rate": ["-1", "-1e-4"],
  "max_num_checkpoints_to_keep": ["-1", "-5"],
  "init_weights_seed": [str(2**40), str(-(2**40))],
  "checkpoint_period": ["0", "-10"],
  "log_period": ["0", "-1"],
  "gradient_accumulation_steps": ["0", "-2"],
}
# Keys the fuzzer leaves alone: where the test writes and which cache it uses (mutating them is tested above).
_KEEP = {"base_output_directory", "jax_cache_dir", "run_name", "metrics_file", "compiled_trainstep_file"}


def _schema() -> dict:
  with open(BASE_YML, encoding="utf-8") as f:
    return yaml.safe_load(f)


def _typo(key: str, rng: random.Random, schema: dict) -> str:
  """A near miss of `key` that is no key: a letter dropped, doubled, swapped or replaced."""
  for _ in range(100):
    i = rng.randrange(len(key))
    kind = rng.choice(["drop", "double", "swap", "replace"])
    if kind == "drop":
      typo = key[:i] + key[i + 1 :]
    elif kind == "double":
      typo = key[:i] + key[i] + key[i:]
    elif kind == "swap" and i < len(key) - 1:
      typo = key[:i] + key[i + 1] + key[i] + key[i + 2 :]
    else:
      typo = key[:i] + rng.choice("abcdefghijklmnopqrstuvwxyz") + key[i + 1 :]
    if typo and typo not in schema and "=" not in typo:
      return typo
  raise AssertionError(f"no typo of {key}")


KINDS = ("typo", "type", "choice", "range", "probed")


def _mutation(rng: random.Random, schema: dict) -> tuple[str, list[str]]:
  """(kind, one random mistake as overrides appended to a valid command line)."""
  keys = sorted(k for k in schema if k not in _KEEP)
  kind = rng.choice(KINDS)
  if kind == "typo":
    key = rng.choice(keys)
    return kind, [f"{_typo(key, rng, schema)}={schema[key]}"]
  if kind == "type":
    typed = [k for k in keys if isinstance(schema[k], (bool, int, float))]
    key = rng.choice(typed)
    default = schema[key]
    bad = _NOT_BOOLS if isinstance(default, bool) else _NOT_INTS if isinstance(default, int) else _NOT_NUMBERS
    return kind, [f"{key}={rng.choice(bad)}"]
  if kind == "choice":
    key = rng.choice(sorted(pyconfig.choices()))
    valid = pyconfig.choices()[key]
    return kind, [
      f"{key}={rng.choice([v for v in ('xyz', 'auto', 'none', 'float8', 'Flash', 'cpu0', '') if v not in valid])}"
    ]
  if kind == "range":
    key = rng.choice(sorted(_NOT_POSITIVE))
    return kind, [f"{key}={rng.choice(_NOT_POSITIVE[key])}"]
  return kind, list(rng.choice(PROBED))


def _cases() -> list[tuple[str, list[str]]]:
  """(kind, overrides) of every case: each probed one once, then random mutations."""
  rng, schema = random.Random(SEED), _schema()
  return [("probed", list(case)) for case in PROBED] + [_mutation(rng, schema) for _ in range(CASES - len(PROBED))]


def _listing(root) -> set[str]:
  return {os.path.relpath(os.path.join(d, n), root) for d, dirs, files in os.walk(root) for n in dirs + files}


def _command_line(valid: list[str], mistake: list[str]) -> list[str]:
  """The valid overrides with the mistake's keys replaced (a key given twice is a mistake of its own, drawn on
  purpose only), then the mistake."""
  mistaken = {arg.split("=", 1)[0] for arg in mistake}
  return [arg for arg in valid if arg.split("=", 1)[0] not in mistaken] + mistake


def test_fuzzed_bad_configs_exit_2_with_one_line_and_write_nothing(tmp_path, capsys, monkeypatch):
  (tmp_path / "a_file").write_text("not a folder\n")
  (tmp_path / "a_folder").mkdir()
  before = _listing(tmp_path)
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # hardware=gpu adds GPU flags: undone after.
  monkeypatch.chdir(tmp_path)  # Relative paths of a mutation land here, where they are checked for.
  valid = overrides(
    "run_name=fuzz", f"base_output_directory={tmp_path}/runs", "steps=2", "enable_checkpointing=true",
    "override_model_config=true",
  )  # fmt: skip
  failures = []
  for _, case in _cases():
    args = _command_line(valid, [arg.replace("{tmp}", str(tmp_path)) for arg in case])
    try:
      code = train.main(["train.py", BASE_YML, *args])
    except BaseException as e:  # noqa: BLE001 (a traceback is a failure to report with the others)
      code = f"{type(e).__name__}: {str(e)[:200]}"
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    written = _listing(tmp_path) - before
    if code != 2 or len(lines) != 1 or not lines[0].startswith("error: ") or "Traceback" in err + out or written:
      failures.append(f"{case}: exit {code}, stderr {err.strip()[-300:]!r}, wrote {sorted(written)[:3]}")
      shutil.rmtree(tmp_path / "runs", ignore_errors=True)
  assert not failures, f"{len(failures)} of {CASES} cases:\n" + "\n".join(failures)


def test_the_fuzzer_draws_every_kind_of_mistake():
  cases = _cases()
  kinds = collections.Counter(kind for kind, _ in cases)
  assert len(cases) == CASES and set(kinds) == set(KINDS) and min(kinds.values()) > 30, kinds
  assert len({tuple(case) for _, case in cases}) > CASES // 2  # mostly distinct command lines


def test_the_valid_command_line_itself_runs(tmp_path):
  """The fuzzer's base command line trains: its failures are the mutations'."""
  valid = overrides("run_name=fuzz", f"base_output_directory={tmp_path}", "steps=1", "override_model_config=true")
  assert train.main(["train.py", BASE_YML, *valid]) == 0
