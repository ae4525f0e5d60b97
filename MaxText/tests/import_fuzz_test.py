"""The Hugging Face importer against hostile folders (issue 43): tensors holding NaN or infinity, integer tensors where
float weights belong (for the four families the issue saw accept NaN, then a bounded fuzz over every family), and a
bounded fuzz of config.json files (wrong JSON at the top, nesting past Python's limit, every field a family reads
given a value of the wrong type, NaN, a huge or negative size). Each ends convert_hf_checkpoint.py with exit code 2
and one line naming the tensor or the field (or imports, where the value turns out valid), within CASE_SECONDS, with
nothing written. The folders are the families' own small random transformers models (their hf_examples, through
the registry), saved once per module."""

import collections
import json
import os
import random
import shutil
import time

import numpy as np
import pytest

from MaxText import checkpointing, convert_hf_checkpoint, families, state
from MaxText.convert import get
from MaxText.tests.helpers import BASE_YML, FUZZ_PARTS, bounded_exit, config, fuzz_part

pytest.importorskip("torch")
pytest.importorskip("transformers")

from MaxText.tests import hf_checkpoint_test as hf_test  # noqa: E402 (needs torch and transformers)

# Every family's first example (its module's hf_examples), by family name.
FIRST_EXAMPLES = {name: next(iter(f.hf_examples)) for name, f in families.FAMILIES.items() if f.hf_examples}
# A fuzz case runs convert_hf_checkpoint.main in this process under a SIGALRM of CASE_SECONDS, so a parse, a model
# build or a read that never ends fails the case instead of hanging the test.
CASE_SECONDS = 20
SEED = 43


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """family name -> a folder holding its first example, saved by transformers (made on first use)."""
  root = tmp_path_factory.mktemp("examples")
  folders = {}

  def get(family: str) -> str:
    if family not in folders:
      folders[family] = str(root / family)
      hf_test.save_random(FIRST_EXAMPLES[family], folders[family])
    return folders[family]

  return get


def _import(folder, out, *extra) -> int:
  argv = ["convert", BASE_YML, f"hf_model_path={folder}", f"base_output_directory={out}", "run_name=imported"]
  return convert_hf_checkpoint.main([*argv, "jax_cache_dir=", *extra])


def _error_lines(err: str) -> list[str]:
  """stderr's lines but for the progress bar's (tqdm redraws "tensors: ..." after carriage returns)."""
  return [line for line in err.splitlines() if line.strip() and not line.startswith("tensors:")]


def _edit_tensor(folder: str, name: str, edit) -> None:
  """Replaces tensor `name` (in whichever shard holds it) by edit(its array)."""
  from safetensors.numpy import load_file, save_file

  for file in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
    tensors = load_file(os.path.join(folder, file))
    if name in tensors:
      tensors[name] = edit(tensors[name])
      save_file(tensors, os.path.join(folder, file), metadata={"format": "pt"})
      return
  raise AssertionError(f"no tensor {name} in {folder}")


def _poison(array: np.ndarray) -> np.ndarray:
  """The array with 3 NaNs, 2 infinities and a -inf spread over it: 6 non-finite values."""
  flat = array.copy().reshape(-1)
  flat[[0, 7, flat.size // 2]] = np.nan
  flat[[1, flat.size - 1]] = np.inf
  flat[flat.size // 3] = -np.inf
  return flat.reshape(array.shape)


# (family, a tensor of its example, where it lands among our params): a layer's projection (scanned: one chunk per
# layer), an embedding table, fused experts (gate and up interleaved) and their down projection.
POISONED = {
  "qwen2": ("model.layers.1.self_attn.q_proj.weight", ["layers.self_attention.query.kernel"]),
  "gemma3": ("model.embed_tokens.weight", ["token_embedder.embedding"]),
  "gpt_oss": ("model.layers.1.mlp.experts.gate_up_proj", ["layers.mlp.wi_0", "layers.mlp.wi_1"]),
  "llama4": ("model.layers.1.feed_forward.experts.down_proj", ["layers.layer_1.mlp.wo"]),
}


@pytest.mark.parametrize("family", sorted(POISONED))
def test_a_tensor_holding_nan_or_infinity_is_refused_naming_it_and_the_count(family, saved, tmp_path, capsys):
  """Exit 2, one line naming the tensor by its Hugging Face name and counting its 6 non-finite values, nothing
  written (the output is staged, and the rest of the tensors are not read); hf_allow_non_finite_weights=true
  imports them as they are."""
  name, ours = POISONED[family]
  folder = str(tmp_path / "hf")
  shutil.copytree(saved(family), folder)
  _edit_tensor(folder, name, _poison)
  out = tmp_path / "out"
  capsys.readouterr()
  assert _import(folder, out) == 2
  err = capsys.readouterr().err
  lines = _error_lines(err)
  assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err[-2000:]
  assert f"tensor {name} holds 6 NaN or infinite values" in lines[0] and "hf_allow_non_finite_weights" in lines[0]
  assert not out.exists(), sorted(str(p) for p in out.rglob("*"))

  assert _import(folder, out, "hf_allow_non_finite_weights=true") == 0
  ckpt = out / "imported" / "checkpoints" / "0"
  cfg = config(f"model_name={ckpt}/model.yml", f"load_parameters_path={ckpt}/items")
  params, _ = checkpointing.restore_host_params(cfg, state.abstract_params(cfg))
  assert sum(np.count_nonzero(~np.isfinite(np.asarray(get(params, path), np.float32))) for path in ours) == 6


@pytest.mark.parametrize("dtype", [np.int8, np.int64, np.bool_])
def test_an_integer_tensor_where_a_float_weight_belongs_is_refused(dtype, saved, tmp_path, capsys):
  """An int8 (or int64, bool) tensor is not cast: one line naming it and its stored dtype, before anything is read."""
  name = "model.layers.2.mlp.down_proj.weight"
  folder = str(tmp_path / "hf")
  shutil.copytree(saved("qwen2"), folder)
  _edit_tensor(folder, name, lambda a: (a * 10).astype(dtype))
  out = tmp_path / "out"
  capsys.readouterr()
  assert _import(folder, out) == 2
  err = capsys.readouterr().err.strip().splitlines()
  stored = {np.int8: "I8", np.int64: "I64", np.bool_: "BOOL"}[dtype]
  assert len(err) == 1 and f"tensor {name} is stored as {stored}, but the parameter it makes is floating-point" in err[0]
  assert not out.exists()


def test_a_finite_value_beyond_weight_dtype_is_refused(saved, tmp_path, capsys):
  """A float32 value of 1e6 is finite in the file but infinite in float16 (largest 65504): weight_dtype=float16
  refuses it in one line naming the tensor; float32 imports it."""
  name = "model.layers.0.mlp.up_proj.weight"
  folder = str(tmp_path / "hf")
  shutil.copytree(saved("qwen2"), folder)
  _edit_tensor(folder, name, lambda a: np.where(np.arange(a.size).reshape(a.shape) == 5, 1e6, a).astype(a.dtype))
  out = tmp_path / "out"
  capsys.readouterr()
  assert _import(folder, out, "weight_dtype=float16") == 2
  lines = _error_lines(capsys.readouterr().err)
  assert len(lines) == 1 and f"tensor {name} has 1 values beyond the range of weight_dtype=float16" in lines[0], lines
  assert not out.exists()
  assert _import(folder, out, "weight_dtype=float32") == 0


# Damaged tensors, drawn with a fixed seed over every family's example: some NaN or infinite values in one tensor, or
# the tensor stored as integers or booleans.
TENSOR_CASES = 72
DAMAGES = ("nan", "inf", "-inf", "mixed", "int8", "int32", "uint8", "bool")
STORED = {"int8": "I8", "int32": "I32", "uint8": "U8", "bool": "BOOL"}


def _tensor_names(folder: str) -> list[str]:
  """The names of a folder's tensors that are parameters (a tied output head saved anyway, or a rotary cache, is left
  out by the import, whatever it holds)."""
  from safetensors import safe_open

  names = []
  for file in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
    with safe_open(os.path.join(folder, file), "numpy") as f:
      names += [n for n in f.keys() if n != "lm_head.weight" and not n.endswith("inv_freq")]
  return sorted(names)


def _damage(array: np.ndarray, damage: str, count: int, rng: random.Random) -> np.ndarray:
  if damage in STORED:
    return (array * 10).astype(np.dtype(damage if damage != "bool" else np.bool_))
  flat = array.copy().reshape(-1)
  values = {"nan": [np.nan], "inf": [np.inf], "-inf": [-np.inf], "mixed": [np.nan, np.inf, -np.inf]}[damage]
  for i in rng.sample(range(flat.size), count):
    flat[i] = rng.choice(values)
  return flat.reshape(array.shape)


@pytest.mark.parametrize("part", FUZZ_PARTS)
def test_fuzzed_damaged_tensors_exit_2_with_one_line_naming_them(part, saved, tmp_path, capsys):
  """Every case: exit 2, one line naming the tensor with its count of non-finite values or its stored dtype, nothing
  written, within CASE_SECONDS."""
  rng = random.Random(SEED)
  cases = []
  for _ in range(TENSOR_CASES):
    family = rng.choice(sorted(FIRST_EXAMPLES))
    cases.append((family, rng.choice(_tensor_names(saved(family))), rng.choice(DAMAGES), rng.randint(1, 5)))
  assert {damage for *_, damage, _ in cases} == set(DAMAGES)
  capsys.readouterr()
  failures = []
  for i, (family, name, damage, count) in fuzz_part(cases, part):
    folder = str(tmp_path / f"hf{i}")
    shutil.copytree(saved(family), folder)
    case_rng = random.Random(i)
    _edit_tensor(folder, name, lambda a: _damage(a, damage, min(count, a.size), case_rng))
    out = tmp_path / f"out{i}"
    code = bounded_exit(lambda: _import(folder, str(out)), CASE_SECONDS)  # noqa: B023 (called at once)
    err = capsys.readouterr().err
    lines = _error_lines(err)
    size = int(np.prod(_shape(folder, name)))
    if damage in STORED:
      want = f"tensor {name} is stored as {STORED[damage]}"
    else:
      want = f"tensor {name} holds {min(count, size)} NaN or infinite values"
    ok = code == 2 and len(lines) == 1 and want in lines[0] and "Traceback" not in err and not out.exists()
    if not ok:
      failures.append(f"case {i} {family} {name} {damage} x{count}: exit {code}, {lines[-2:]}")
    shutil.rmtree(folder)
  assert not failures, f"{len(failures)} cases:\n" + "\n".join(failures)


def _shape(folder: str, name: str) -> tuple[int, ...]:
  from safetensors import safe_open

  for file in sorted(f for f in os.listdir(folder) if f.endswith(".safetensors")):
    with safe_open(os.path.join(folder, file), "numpy") as f:
      if name in f.keys():
        return tuple(f.get_slice(name).get_shape())
  raise AssertionError(name)


# ------------------------------------------------------------------------------------------ config.json
CASES = 420

# Values of the wrong JSON type for any field (a string for a number, a list, an object, NaN, ...) and values of
# the right type that may be out of range. `DEEP` nests within Python's recursion limit; the file cases below
# nest past it.
DEEP = json.loads("[" * 50 + "]" * 50)
WRONG_TYPES = ["64", "x", "", [], [1, 2], {}, {"a": 1}, DEEP, float("nan"), float("inf"), -float("inf"), 1e308]
OUT_OF_RANGE = [0, -1, -64, 2**31, 2**64, 10**40, 3, 1.5, 0.0, True, False, None]

# The JSON types a value of each of the importer's field kinds has (hf_families.FIELDS' kinds, by what they say).
INTEGER, NUMBER, BOOL, STRING, LIST, OBJECT = "integer", "number", "bool", "string", "list", "object"
KIND_TYPES = {
  "a positive integer below 2**31": {INTEGER},
  "a positive integer up to 65536": {INTEGER},
  "an integer from 0 below 2**31": {INTEGER},
  "a finite number (float32's range)": {INTEGER, NUMBER},
  "a positive finite number (float32's range)": {INTEGER, NUMBER},
  "true or false": {BOOL, INTEGER},
  "a string": {STRING},
  "a list of strings": {LIST},
  "a list of integers from 0": {LIST},
  "an object": {OBJECT},
}


def _json_type(value) -> str | None:
  if isinstance(value, bool):
    return BOOL
  if isinstance(value, int):
    return INTEGER
  if isinstance(value, float):
    return NUMBER if np.isfinite(value) else None  # NaN and infinities are no JSON numbers
  return {str: STRING, list: LIST, dict: OBJECT}.get(type(value))


def _fields(hf: dict) -> list[tuple[tuple[str, ...], str]]:
  """(path of a field in config.json, the kind it must be) of every field an example's config.json has that a family
  reads: top-level ones, and those of its RoPE objects."""
  from MaxText.convert import hf_families

  found = [((key,), hf_families.FIELDS[key].what) for key in hf if key in hf_families.FIELDS]
  for rope in ("rope_scaling", "rope_parameters"):
    if isinstance(hf.get(rope), dict):
      found += [((rope, key), hf_families.ROPE_FIELDS[key].what) for key in hf[rope] if key in hf_families.ROPE_FIELDS]
  return found


# Whole config.json files: (kind, the bytes); each is refused in one line.
def _deep(opening: bytes, closing: bytes, depth: int = 100_000) -> bytes:
  return opening * depth + closing * depth


FILES = [
  ("top_list", b"[1, 2, 3]"),
  ("top_string", b'"a config"'),
  ("top_number", b"64"),
  ("top_null", b"null"),
  ("empty", b""),
  ("not_json", b"{hidden_size: 64}"),
  ("deep_list", _deep(b"[", b"]")),
  ("deep_object", b'{"a": ' * 100_000 + b"1" + b"}" * 100_000),
  ("deep_value", b'{"model_type": "qwen2", "hidden_size": ' + _deep(b"[", b"]") + b"}"),
  ("huge_integer", b'{"model_type": "qwen2", "hidden_size": ' + b"9" * 5000 + b"}"),
  ("not_utf8", b'{"model_type": "\xff\xfe"}'),
  ("nul", b'{"model_type": "qwen2\x00"}'),
  ("model_type_list", b'{"model_type": ["qwen2"]}'),
  ("model_type_object", b'{"model_type": {"qwen2": 1}}'),
]


def _config_case(rng: random.Random, examples: dict) -> tuple:
  """(kind, family, the config.json bytes, the field the line must name or None, may it import)."""
  roll = rng.random()
  if roll < 0.08:
    kind, data = rng.choice(FILES)
    return kind, "qwen2", data, None, False
  family = rng.choice(sorted(examples))
  hf = json.loads(json.dumps(examples[family]))
  fields = _fields(hf)
  if roll < 0.16:  # a field of no family's: ignored, whatever it holds
    key = rng.choice([k for k in hf if k not in dict((path[0], 0) for path, _ in fields)] or ["unused"])
    hf[key] = rng.choice(WRONG_TYPES)
    return "unread_field", family, json.dumps(hf).encode(), None, True
  path, what = rng.choice(fields)
  value = rng.choice(WRONG_TYPES if roll < 0.7 else OUT_OF_RANGE)
  parent = hf
  for key in path[:-1]:
    parent = parent[key]
  parent[path[-1]] = value
  wrong = value is not None and _json_type(value) not in KIND_TYPES[what]
  kind = "wrong_type" if wrong else "range"
  return kind, family, json.dumps(hf).encode(), ".".join(path) if wrong else None, not wrong


def _cases(examples: dict) -> list[tuple]:
  rng = random.Random(SEED)
  return [(kind, "qwen2", data, None, False) for kind, data in FILES] + [
    _config_case(rng, examples) for _ in range(CASES - len(FILES))
  ]


def _examples(saved) -> dict:
  """family -> its first example's config.json, as transformers saved it."""
  return {family: json.load(open(os.path.join(saved(family), "config.json"))) for family in sorted(FIRST_EXAMPLES)}


@pytest.mark.parametrize("part", FUZZ_PARTS)
def test_fuzzed_config_json_exits_2_with_one_line_naming_the_field(part, saved, tmp_path, capsys):
  """Every case: exit 2 with one `error: ` line (naming the field, for a value of the wrong type), nothing written,
  no traceback, within CASE_SECONDS; or, for a value that is valid after all (a field no family reads, a size in
  range), an import (exit 0) that is then removed."""
  examples = _examples(saved)
  failures, outcomes = [], collections.Counter()
  cases = fuzz_part(_cases(examples), part)
  capsys.readouterr()  # saving the examples' own output
  for i, (kind, family, data, field, may_import) in cases:
    folder = tmp_path / f"hf{i}"
    folder.mkdir()
    (folder / "config.json").write_bytes(data)
    for name in os.listdir(saved(family)):
      if name.endswith(".safetensors") or name.endswith(".index.json"):
        os.symlink(os.path.join(saved(family), name), folder / name)
    out = tmp_path / f"out{i}"
    start = time.monotonic()
    code = bounded_exit(lambda: _import(str(folder), str(out)), CASE_SECONDS)  # noqa: B023 (called at once)
    seconds = time.monotonic() - start
    stdout, err = capsys.readouterr()
    lines = _error_lines(err)
    outcomes[code if isinstance(code, int) else "raised"] += 1
    if code == 0 and may_import:
      ok = "Traceback" not in err
    else:
      ok = code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and not out.exists()
      ok = ok and "Traceback" not in err + stdout and (field is None or field.split(".")[-1] in lines[0])
    if not ok:
      failures.append(f"case {i} {kind} {family} {data[:150]!r}: exit {code}, {seconds:.1f} s, {lines[-3:]}")
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(folder)
  assert not failures, f"{len(failures)} of {len(cases)} cases:\n" + "\n".join(failures)
  assert outcomes[2] > len(cases) * 0.6, outcomes


def test_the_fuzzer_draws_every_kind_of_case(saved):
  """The cases cover each whole-file trick, wrong types and ranges, in fields of every family's example."""
  cases = _cases(_examples(saved))
  kinds = collections.Counter(kind for kind, *_ in cases)
  assert len(cases) == CASES and {kind for kind, _ in FILES} <= set(kinds)
  assert kinds["wrong_type"] > 150 and kinds["range"] > 50 and kinds["unread_field"] > 10, kinds
  assert {family for _, family, *_ in cases} == set(FIRST_EXAMPLES)


def test_every_field_of_every_example_is_a_known_kind(saved):
  """The fields the fuzzer mutates: every family's example has some, and each kind is one the fuzzer knows."""
  for family, hf in _examples(saved).items():
    fields = _fields(hf)
    assert fields, family
    assert {what for _, what in fields} <= set(KIND_TYPES), family
