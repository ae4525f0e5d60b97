"""Fuzzed command lines and config files: a few hundred bad configurations, drawn with a fixed seed from the
mistakes users make (every case of issue 15's probe, plus random mutations of a valid command line) and from YAML's
tricks and paths that are no regular file (issue 29), each of which must end train.py with exit code 2 and one
line on stderr, no traceback, and nothing written."""

import collections
import os
import random
import shutil
import time

import pytest
import yaml

from MaxText import pyconfig, train
from MaxText.tests.helpers import BASE_YML, FUZZ_PARTS, bounded_exit, fuzz_part, overrides

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


@pytest.mark.parametrize("part", FUZZ_PARTS)
def test_fuzzed_bad_configs_exit_2_with_one_line_and_write_nothing(part, tmp_path, capsys, monkeypatch):
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
  cases = fuzz_part(_cases(), part)
  for _, (_, case) in cases:
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
  assert not failures, f"{len(failures)} of {len(cases)} cases:\n" + "\n".join(failures)


def test_the_fuzzer_draws_every_kind_of_mistake():
  cases = _cases()
  kinds = collections.Counter(kind for kind, _ in cases)
  assert len(cases) == CASES and set(kinds) == set(KINDS) and min(kinds.values()) > 30, kinds
  assert len({tuple(case) for _, case in cases}) > CASES // 2  # mostly distinct command lines


def test_the_valid_command_line_itself_runs(tmp_path, capsys):
  """The fuzzer's base command line trains: its failures are the mutations'. It trains the step it asks for: the
  loss it prints is the metrics file's (to the 4 printed decimals), and the run folder's config.yml holds its keys."""
  import json
  import re

  metrics = tmp_path / "m.jsonl"
  valid = overrides("run_name=fuzz", f"base_output_directory={tmp_path}", "steps=1", "override_model_config=true",
                    f"metrics_file={metrics}")  # fmt: skip
  capsys.readouterr()
  assert train.main(["train.py", BASE_YML, *valid]) == 0
  (printed,) = re.findall(r"completed step: 0, .*loss: ([-\d.]+)", capsys.readouterr().out)
  records = [json.loads(line) for line in metrics.read_text().splitlines()]
  assert [r["step"] for r in records if "learning/loss" in r] == [0] and "goodput" in records[-1]
  assert abs(records[0]["learning/loss"] - float(printed)) <= 5e-5, (records[0], printed)
  written = yaml.safe_load((tmp_path / "fuzz" / "config.yml").read_text())
  assert written["steps"] == 1 and written["run_name"] == "fuzz" and written["metrics_file"] == str(metrics)


# ------------------------------------------------------------------------------------------ config files
# Generated config FILES (issue 29): YAML's tricks, and paths that are no regular file. Each case runs train.main
# in this process under a SIGALRM of CASE_SECONDS, so a parse that never ends (an alias bomb, a FIFO opened for
# reading) fails the case instead of hanging the test.
FILE_CASES = 300
FILE_SEED = 29
CASE_SECONDS = 10
# Longest error line a case may print: values are quoted cut (common_types.shown), so a line stays readable.
READABLE_CHARS = 1000

# Valid lines a generated file starts from (the command line's overrides win over them).
_VALID_LINES = ["steps: 1", "log_period: 1", "learning_rate: 1.0e-3", "mlp_activations: ['silu', 'linear']",
                "enable_tensorboard: false", "# a comment", "warmup_steps_fraction: 0.1"]  # fmt: skip
_FLOAT_KEYS = ["learning_rate", "adam_b1", "warmup_steps_fraction", "dropout_rate", "per_device_batch_size"]
_INT_KEYS = ["steps", "log_period", "checkpoint_period", "gradient_accumulation_steps", "init_weights_seed"]
_LIST_KEYS = ["mlp_activations", "lora_target_modules", "train_data_columns", "logical_axis_rules"]
_ANY_KEYS = [*_FLOAT_KEYS, *_INT_KEYS, *_LIST_KEYS, "run_name", "attention", "scan_layers"]


def _alias_bomb(rng: random.Random) -> str:
  """Nested aliases, width**depth strings once expanded (9**9 is 387 million): in one list value, or as keys."""
  width, depth = rng.randint(2, 9), rng.randint(2, 9)
  names = [f"l{i}" for i in range(depth)]
  lists = [f"&{names[0]} [{', '.join(['lol'] * width)}]"]
  lists += [f"&{b} [{', '.join([f'*{a}'] * width)}]" for a, b in zip(names[:-1], names[1:], strict=True)]
  if rng.random() < 0.5:
    return f"{rng.choice(_LIST_KEYS)}: [{', '.join(lists)}, *{names[-1]}]"
  return "\n".join(
    [*(f"{name}: {text}" for name, text in zip(names, lists, strict=True)), f"{rng.choice(_LIST_KEYS)}: [*{names[-1]}]"]
  )


def _deep(rng: random.Random) -> str:
  depth = rng.choice([40, 200, 1000, 5000, 20000])
  if rng.random() < 0.5:
    return f"{rng.choice(_ANY_KEYS)}: {'[' * depth}{']' * depth}"
  return f"{rng.choice(_ANY_KEYS)}: {'{a: ' * depth}1{'}' * depth}"


# Each trick -> a text (or bytes) that makes a file invalid, whichever valid lines surround it.
TRICKS = {
  "anchor": lambda rng: f"{rng.choice(_INT_KEYS)}: &n 3\n{rng.choice(_INT_KEYS)}: *n",
  "anchor_only": lambda rng: f"{rng.choice(_ANY_KEYS)}: &unused [a, b]",
  "merge": lambda rng: rng.choice(["<<: {steps: 3}", "a: &m {steps: 3}\n<<: *m", "<<: [{log_period: 2}]"]),
  "alias_bomb": _alias_bomb,
  "python_tag": lambda rng: (
    f"{rng.choice(_ANY_KEYS)}: "
    + rng.choice(
      [
        "!!python/object:os.system [ls]",
        "!!python/name:os.system",
        "!!python/object/apply:os.system ['true']",
        "!!python/tuple [1, 2]",
        "!!python/module:os",
        "!custom 3",
      ]
    )
  ),  # fmt: skip
  "binary": lambda rng: f"{rng.choice(_ANY_KEYS)}: !!binary aGVsbG8gd29ybGQ=",
  "huge_int": lambda rng: f"{rng.choice(_INT_KEYS + _FLOAT_KEYS)}: {rng.choice('123456789')}{'0' * rng.randint(20, 20000)}",
  "non_finite": lambda rng: f"{rng.choice(_FLOAT_KEYS)}: {rng.choice(['.nan', '.inf', '-.inf', '1.0e+999', 'nan'])}",
  "deep": _deep,
  "duplicate": lambda rng: "{0}: 1\n{0}: 2".format(rng.choice(_INT_KEYS)),
  "non_utf8": lambda rng: bytes([rng.randint(0x80, 0xFF)]) + b": 1",
  "nul": lambda rng: rng.choice([b"steps: 1\x00", b"\x00", b"run_name: a\x00b"]),
  "non_string_key": lambda rng: rng.choice(["1: 2", "~: 3", "true: 4", "? [a, b]\n: 5", "2001-01-01: x", "1.5: y"]),
  "bad_type": lambda rng: f"{rng.choice(_INT_KEYS)}: " + rng.choice(["!!set {a}", "!!timestamp 2001-12-14", "[1]", "{}"]),
  "documents": lambda rng: "---\nsteps: 2\n---\nsteps: 3",
  "long_value": lambda rng: f"{rng.choice(['run_name', 'attention'])}: [{', '.join(['x' * 50] * rng.randint(100, 5000))}]",
  "long_key": lambda rng: f"{'k' * rng.randint(300, 100000)}: 1",
}

# Whole files that are valid (a run trains) or not, drawn for the "top_level" kind.
TOP_LEVEL = [("", True), ("# only a comment\n", True), ("- a\n- b\n", False), ("just a string\n", False),
             ("42\n", False), ("~\n", True), ("[steps, 3]\n", False), ("\ufeffsteps: 1\r\n", True)]  # fmt: skip

FILE_KINDS = (*TRICKS, "top_level", "base_config_cycle", "base_config_special", "config_path_special")

# What a path given as the config file, or as a base_config, can be (made in the test's case folder).
SPECIAL_PATHS = ["folder", "fifo", "/dev/zero", "/dev/null", "missing.yml", "zero_link", "dangling_link"]


def _special_path(name: str, cases) -> str:
  if name.startswith("/"):
    return name
  return str(cases / name)


def _file_case(rng: random.Random) -> tuple[str, dict, str, bool]:
  """(kind, {file name: content}, the config path argument (a name in the case folder, or special), valid)."""
  kind = rng.choice(FILE_KINDS)
  base = f"base_config: {BASE_YML}"
  lines = [base, *rng.sample(_VALID_LINES, rng.randint(0, 4))]
  if kind == "base_config_cycle":
    return kind, rng.choice([
      {"a.yml": "base_config: a.yml\n"}, {"a.yml": "base_config: ./a.yml\n"},
      {"a.yml": "base_config: b.yml\nsteps: 1\n", "b.yml": "base_config: ./a.yml\n"},
      {"a.yml": "base_config: sub/../a.yml\n"},
    ]), "a.yml", False  # fmt: skip
  if kind == "base_config_special":
    target = rng.choice(SPECIAL_PATHS)
    return kind, {"a.yml": f"base_config: {target}\n" + "\n".join(lines[1:]) + "\n"}, "a.yml", False
  if kind == "config_path_special":
    return kind, {}, rng.choice(SPECIAL_PATHS), False
  if kind == "top_level":
    text, valid = rng.choice(TOP_LEVEL)
    return kind, {"a.yml": text}, "a.yml", valid
  trick = TRICKS[kind](rng)
  parts = [line.encode() for line in lines]
  parts.insert(rng.randint(1, len(parts)), trick if isinstance(trick, bytes) else trick.encode())
  return kind, {"a.yml": b"\n".join(parts) + b"\n"}, "a.yml", False


def _file_cases() -> list[tuple[str, dict, str, bool]]:
  rng = random.Random(FILE_SEED)
  return [_file_case(rng) for _ in range(FILE_CASES)]


def _make_case_folder(cases) -> None:
  """The special paths of SPECIAL_PATHS that live in the case folder, and a folder "sub" for a cycle through it."""
  (cases / "folder").mkdir()
  (cases / "sub").mkdir()
  os.mkfifo(cases / "fifo")
  os.symlink("/dev/zero", cases / "zero_link")
  os.symlink(cases / "nowhere", cases / "dangling_link")


@pytest.mark.parametrize("part", FUZZ_PARTS)
def test_fuzzed_config_files_exit_2_with_one_line_within_seconds(part, tmp_path, tmp_path_factory, capsys, monkeypatch):
  """Each generated config file ends train.py with exit 2 and one short `error: ` line, with no traceback, nothing
  written, within CASE_SECONDS; a file that is valid after all (an empty one, comments only) trains instead."""
  case_folder = tmp_path_factory.mktemp("cases")
  _make_case_folder(case_folder)
  monkeypatch.chdir(tmp_path)
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
  valid = overrides(f"base_output_directory={tmp_path}/runs", "steps=1", "run_name=fuzz")
  before, case_files = _listing(tmp_path), _listing(case_folder)
  failures, outcomes = [], collections.Counter()
  cases = fuzz_part(_file_cases(), part)
  for i, (kind, files, config_path, is_valid) in cases:
    for name, content in files.items():
      (case_folder / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    start = time.monotonic()
    path = _special_path(config_path, case_folder)
    code = bounded_exit(lambda: train.main(["train.py", path, *valid]), CASE_SECONDS)  # noqa: B023 (called at once)
    seconds = time.monotonic() - start
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    written = _listing(tmp_path) - before
    outcomes[code if isinstance(code, int) else "raised"] += 1
    if is_valid:
      ok = code == 0 and not err.strip()
    else:
      ok = code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and not written
      ok = ok and len(lines[0]) <= READABLE_CHARS
    if not ok or "Traceback" in err + out:
      failures.append(f"case {i} {kind} {files or config_path}"[:300] + f": exit {code}, {seconds:.1f} s, stderr "
                      f"{err.strip()[-300:]!r}, wrote {sorted(written)[:3]}")  # fmt: skip
    shutil.rmtree(tmp_path / "runs", ignore_errors=True)
    for name in files:
      os.remove(case_folder / name)
  assert not failures, f"{len(failures)} of {len(cases)} cases:\n" + "\n".join(failures)
  assert _listing(case_folder) == case_files  # nothing written beside the config files either
  assert outcomes[2] > len(cases) * 0.9, outcomes


def test_the_file_fuzzer_draws_every_trick():
  kinds = collections.Counter(kind for kind, *_ in _file_cases())
  assert set(kinds) == set(FILE_KINDS), kinds
  assert min(kinds.values()) >= 5, kinds
