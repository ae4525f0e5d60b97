"""Fuzzed fine-tuning data: a few hundred SFT and DPO data files drawn with a fixed seed from the ways data goes
wrong (not JSON, binary, NUL bytes, not UTF-8, empty, blank lines, arrays or scalars per line, missing or
mistyped columns, unknown roles, nested garbage, a huge line, records longer than max_target_length, good and bad
records mixed, and paths that are a FIFO, /dev/zero or a folder). Each must end within a deadline, through the
data layer train.py uses (input_pipeline.check, then the first batch of create_iterator), either in a
ConfigError of one printable line or, for data that is acceptable, in a batch with targets in the loss; a few
end the same way through train.main's command line (exit 2, one `error: ` line, nothing written)."""

import collections
import json
import os
import random
import unicodedata

import jax
import numpy as np
import pytest

from MaxText import input_pipeline, objectives, sharding, train
from MaxText.common_types import ConfigError
from MaxText.tests.helpers import BASE_YML, FUZZ_PARTS, config, deadline, fuzz_part, overrides
from MaxText.tests.sft_test import _long_conversations, files  # noqa: F401 (a fixture)

SEED = 29
PER_KIND = 9
WORDS = "Which book is this verse from In the beginning God created Genesis Hamlet sea sun moon".split()
# How a case must end: a batch, a ConfigError, or either (a bad record after the first ones check() reads may be
# met before or after the first batch).
BATCH, ERROR, EITHER = "batch", "error", "either"


def _text(rng: random.Random, low=1, high=12) -> str:
  return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def _conversation(rng: random.Random) -> dict:
  turns = [{"role": "system", "content": _text(rng)}] if rng.random() < 0.3 else []
  for _ in range(rng.randint(1, 2)):
    turns += [{"role": "user", "content": _text(rng)}, {"role": "assistant", "content": _text(rng)}]
  return {"messages": turns}


def _pair(rng: random.Random) -> dict:
  return {"prompt": _text(rng), "chosen": _text(rng), "rejected": _text(rng)}


def _lines(records) -> bytes:
  return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()


def _garbage(rng: random.Random, depth=0):
  """A random JSON value: scalars, lists and objects nested up to 4 deep, with odd keys and control characters."""
  kind = rng.randrange(7 if depth < 4 else 4)
  if kind == 0:
    return rng.choice([None, True, False, 0, -1, 1.5e308, "", "\x1b]0;x\x07", "\x7f\x9b"])
  if kind == 1:
    return rng.randint(-(2**40), 2**40)
  if kind in (2, 3):
    return "".join(chr(rng.choice([rng.randint(0, 0x7F), rng.randint(0x80, 0x2FFF)])) for _ in range(rng.randint(0, 9)))
  if kind == 4:
    return [_garbage(rng, depth + 1) for _ in range(rng.randint(0, 3))]
  keys = ["role", "content", "messages", "", "\x00", "prompt"]
  return {rng.choice(keys): _garbage(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def _good(rng):
  return _lines(_conversation(rng) for _ in range(rng.randint(6, 30)))


def _mixed_bad(rng):
  records = [_conversation(rng) for _ in range(rng.randint(10, 20))]
  bad = [{"text": "x"}, {"messages": "hello"}, {"messages": [{"role": "robot", "content": "x"}]}, {"messages": []}]
  for _ in range(rng.randint(1, 3)):
    records.insert(rng.randrange(len(records) + 1), rng.choice(bad))
  return _lines(records)


def _not_utf8(rng):
  records = [_conversation(rng) for _ in range(rng.randint(2, 9))]
  data = bytearray(_lines(records))
  data[rng.randrange(len(data))] = rng.choice([0x80, 0xC3, 0xE9, 0xFF])
  return bytes(data)


# kind -> (columns, what it writes: rng -> bytes, or a special path, how it must end)
KINDS = {
  "good": ("sft", _good, BATCH),
  "good_array": ("sft", lambda rng: json.dumps([_conversation(rng) for _ in range(rng.randint(6, 20))]).encode(), BATCH),
  "good_blank_lines": ("sft", lambda rng: _good(rng).replace(b"\n", b"\n\n \n"), BATCH),
  "good_and_too_long": (
    "sft",
    lambda rng: _lines([*_long_conversations(rng.randint(1, 9), seed=rng.randrange(99)), _conversation(rng)]),
    BATCH,
  ),
  "text": ("sft", lambda rng: "\n".join(_text(rng) for _ in range(rng.randint(1, 20))).encode(), ERROR),
  "binary": ("sft", lambda rng: bytes(rng.randrange(256) for _ in range(rng.randint(1, 4000))), ERROR),
  "nul": ("sft", lambda rng: b"\x00" * rng.randint(1, 99) + _good(rng), ERROR),
  "not_utf8": ("sft", _not_utf8, ERROR),
  "empty": ("sft", lambda rng: b"", ERROR),
  "blank_lines": ("sft", lambda rng: rng.choice([b"\n", b" ", b"\r\n", b"\t"]) * rng.randint(1, 50), ERROR),
  "arrays": ("sft", lambda rng: _lines([[_conversation(rng)] for _ in range(rng.randint(2, 9))]), ERROR),  # 1: valid
  "scalars": ("sft", lambda rng: _lines(rng.choice([1, "x", None, True, 2.5]) for _ in range(rng.randint(1, 9))), ERROR),
  "missing_column": ("sft", lambda rng: _lines({"text": _text(rng)} for _ in range(rng.randint(1, 9))), ERROR),
  "wrong_type": (
    "sft",
    lambda rng: _lines({"messages": rng.choice(["hi", 3, None, {"role": "user"}, ["a", "b"]])} for _ in range(9)),
    ERROR,
  ),
  "wrong_roles": (
    "sft",
    lambda rng: _lines(
      {"messages": [{"role": rng.choice(["robot", "User", "", "assistant\x1b"]), "content": "x"}]} for _ in range(9)
    ),
    ERROR,
  ),
  "nested_garbage": ("sft", lambda rng: _lines({"messages": _garbage(rng)} for _ in range(rng.randint(1, 9))), ERROR),
  "deep_nesting": ("sft", lambda rng: b'{"messages": ' + b"[" * rng.randint(10_000, 100_000) + b"\n", ERROR),
  "huge_line": ("sft", lambda rng: _lines(_long_conversations(1, words=rng.randint(50_000, 100_000))), ERROR),
  "too_long": ("sft", lambda rng: _lines(_long_conversations(rng.randint(1, 20), seed=rng.randrange(99))), ERROR),
  "truncated": ("sft", lambda rng: _good(rng)[: -rng.randint(3, 20)], ERROR),
  "mixed_bad": ("sft", _mixed_bad, EITHER),
  "dpo_good": ("dpo", lambda rng: _lines(_pair(rng) for _ in range(rng.randint(6, 20))), BATCH),
  "dpo_missing": ("dpo", lambda rng: _lines({"prompt": _text(rng), "chosen": _text(rng)} for _ in range(9)), ERROR),
  "dpo_wrong_type": (
    "dpo",
    lambda rng: _lines({"prompt": _text(rng), "chosen": rng.choice([1, None, {}]), "rejected": "x"} for _ in range(9)),
    ERROR,
  ),
  "dpo_garbage": (
    "dpo",
    lambda rng: _lines({k: _garbage(rng) for k in ("prompt", "chosen", "rejected")} for _ in range(9)),
    ERROR,
  ),
  "dpo_too_long": (
    "dpo",
    lambda rng: _lines(
      {"prompt": " ".join(rng.choice(WORDS) for _ in range(300)), "chosen": "a", "rejected": "b"}
      for _ in range(rng.randint(1, 9))
    ),  # fmt: skip
    ERROR,
  ),
  "fifo": ("sft", "fifo", ERROR),
  "dev_zero": ("sft", "/dev/zero", ERROR),
  "folder": ("sft", "folder", ERROR),
}


# Kinds drawn fewer times: a path (one FIFO, /dev/zero, one folder), or a case that costs a second (a 0.5 MB line).
COUNTS = {"fifo": 1, "dev_zero": 1, "folder": 1, "huge_line": 2}


def _cases() -> list[tuple[str, int]]:
  return [(kind, i) for kind in KINDS for i in range(COUNTS.get(kind, PER_KIND))]


def _write(tmp_path, kind: str, i: int) -> str:
  """The data path of case (kind, i), written."""
  columns, write, _ = KINDS[kind]
  if write == "fifo":
    os.mkfifo(tmp_path / "fifo.jsonl")
    return str(tmp_path / "fifo.jsonl")
  if write == "folder":
    return str(tmp_path)
  if isinstance(write, str):
    return write
  path = tmp_path / f"{kind}-{i}.jsonl"
  path.write_bytes(write(random.Random(f"{SEED}-{kind}-{i}")))
  return str(path)


def _config(files, columns: str, path: str, *extra):  # noqa: F811
  mode = (
    ("use_sft=true", "sft_train_on_completion_only=true", "train_data_columns=['messages']")
    if columns == "sft"
    else ("use_dpo=true", "train_data_columns=['prompt','chosen','rejected']")
  )
  return config(
    *mode, "use_chat_template=true", "dataset_type=hf", "hf_path=json", f"hf_train_files={path}",
    f"tokenizer_path={files}/hf/tokenizer.json", "tokenizer_type=huggingface", "vocab_size=512",
    "override_model_config=true", "per_device_batch_size=2", *extra,
  )  # fmt: skip


def _outcome(cfg) -> tuple[str, str]:
  """(BATCH or ERROR, what): the first batch of the data layer train.py uses, or its ConfigError."""
  try:
    with deadline(20):
      examples = objectives.get(cfg).examples  # the records as the run's objective reads them
      input_pipeline.check(cfg, examples)
      batch = next(input_pipeline.create_iterator(cfg, sharding.create_mesh(cfg, jax.devices()[:1]), examples=examples))
  except ConfigError as e:
    return ERROR, str(e)
  keys = [k for k in batch if k.endswith("targets_segmentation")]
  return BATCH, f"{sum(int(np.asarray(batch[k]).astype(bool).sum()) for k in keys)} targets in the loss"


@pytest.mark.parametrize("part", FUZZ_PARTS)
def test_fuzzed_data_ends_in_one_line_or_a_batch(part, files, tmp_path, monkeypatch):  # noqa: F811
  import datasets

  monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_cache"))  # not the user's cache
  failures, seen = [], collections.Counter()
  cases = fuzz_part(_cases(), part)
  for _, (kind, i) in cases:
    case = tmp_path / f"case-{kind}-{i}"
    case.mkdir()
    columns, _, expected = KINDS[kind]
    try:
      got, what = _outcome(_config(files, columns, _write(case, kind, i)))
    except BaseException as e:  # noqa: BLE001 (a traceback or a hang is a failure to report with the others)
      got, what = type(e).__name__, str(e)[:300]
    seen[got] += 1
    printable = all(unicodedata.category(c) != "Cc" for c in what)
    if got not in (BATCH, ERROR) or expected not in (got, EITHER) or not printable or len(what) > 1000:
      failures.append(f"{kind}-{i}: expected {expected}, got {got}: {what!r}")
    elif got == BATCH and what.startswith("0 "):
      failures.append(f"{kind}-{i}: a batch without targets in the loss")
  assert not failures, f"{len(failures)} of {len(cases)} cases:\n" + "\n".join(failures)
  share = len(cases) / len(_cases())  # of the 230 cases, at least 30 give a batch and 100 an error
  assert seen[BATCH] >= int(30 * share) and seen[ERROR] >= int(100 * share), seen


@pytest.mark.parametrize("kind", ["too_long", "binary", "dpo_too_long"])
def test_fuzzed_data_through_the_command_line_exits_2_and_writes_nothing(files, tmp_path, capsys, kind):  # noqa: F811
  """The issue's hang (20 conversations of 200 words, max_target_length=64), a binary file and DPO pairs too long:
  train.main exits 2 with one `error: ` line, promptly, and writes nothing."""
  data = tmp_path / "data"
  data.mkdir()
  path = _write(data, kind, 0)
  if kind == "too_long":
    (data / "issue.jsonl").write_bytes(_lines(_long_conversations(20, words=200)))
    path = str(data / "issue.jsonl")
  yml = os.path.join(os.path.dirname(BASE_YML), "sft.yml" if KINDS[kind][0] == "sft" else "dpo.yml")
  args = overrides(
    "run_name=fuzz", f"base_output_directory={tmp_path}/out", "steps=2", "hf_path=json", f"hf_train_files={path}",
    f"tokenizer_path={files}/hf/tokenizer.json", "tokenizer_type=huggingface", "vocab_size=512",
    "override_model_config=true", "enable_checkpointing=true", "max_target_length=64",
  )  # fmt: skip
  with deadline(120):
    code = train.main(["train.py", yml, *args])
  out, err = capsys.readouterr()
  lines = err.strip().splitlines()
  assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in out + err, err
  assert {"too_long": "fits max_target_length=64", "binary": "data/binary-0.jsonl", "dpo_too_long": "fits"}[kind] in err
  assert not (tmp_path / "out").exists()


def test_the_fuzzer_draws_every_kind():
  kinds = collections.Counter(kind for kind, _ in _cases())
  assert set(kinds) == set(KINDS) and len(_cases()) > 200, kinds
  assert {KINDS[kind][2] for kind in kinds} == {BATCH, ERROR, EITHER}
