"""Text pipelines: packing, determinism, process shards, exact resume with Grain, and bad data paths."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from MaxText import train_tokenizer
from MaxText.input_pipeline import text_pipeline
from MaxText.objectives import lm as lm_lib
from MaxText.tests.helpers import BASE_YML, REPO_ROOT, config, metrics_losses, run
from MaxText.tests.helpers import overrides as overrides_of
from MaxText.tests.sft_test import files  # noqa: F401 (a fixture)


class ByteTokens:
  """A stand-in tokenizer: a document's bytes are its tokens."""

  def __call__(self, text: bytes) -> np.ndarray:
    return np.frombuffer(text, np.uint8).astype(np.int32)


def _pack(documents, length=8, rows=2, **kw):
  kw = {"seed": 0, "num_epochs": 1, "process_index": 0, "process_count": 1, "shuffle": False, **kw}
  dataset = text_pipeline.make_dataset(documents, tokenize=ByteTokens(), length=length, rows=rows, **kw)
  return list(dataset)


def _pieces(batches):
  """The (inputs, targets) of every packed piece, read back through segment ids and positions."""
  pieces = []
  for batch in batches:
    for r in range(batch["inputs"].shape[0]):
      seg, pos = batch["inputs_segmentation"][r], batch["inputs_position"][r]
      np.testing.assert_array_equal(seg, batch["targets_segmentation"][r])
      for s in np.unique(seg[seg > 0]):
        where = np.flatnonzero(seg == s)
        assert np.all(np.diff(where) == 1), "a piece must be contiguous"
        np.testing.assert_array_equal(pos[where], np.arange(len(where)))
        pieces.append((batch["inputs"][r, where].tolist(), batch["targets"][r, where].tolist()))
      assert np.all(batch["inputs"][r, seg == 0] == 0) and np.all(pos[seg == 0] == 0)
  return pieces


def test_packing_places_every_token_once_in_order():
  lengths = [3, 9, 2, 20, 1, 5, 8, 17]
  documents = [bytes((30 * i + np.arange(n)).astype(np.uint8)) for i, n in enumerate(lengths)]  # ids tell the document
  pieces = _pieces(_pack(documents, length=8, rows=1))
  by_document = {}
  for inputs, targets in pieces:
    assert len(inputs) <= 8 and targets[:-1] == inputs[1:]
    by_document.setdefault(inputs[0] // 30, []).append((inputs, targets))
  for i, document in enumerate(documents):
    tokens = list(document)
    if len(tokens) < 2:  # One token: nothing to predict.
      assert i not in by_document
      continue
    got = by_document[i]
    assert [t for inputs, _ in got for t in inputs] == tokens[:-1]  # every input token once, in order
    assert [t for _, targets in got for t in targets] == tokens[1:]  # and every target token


def test_padding_is_masked_out_of_the_loss():
  import jax

  from MaxText.layers import models

  cfg = config("max_target_length=8", "vocab_size=256", "override_model_config=true")
  batch = {k: np.asarray(v) for k, v in _pack([b"abcdefghijk", b"xyz", b"pq"], length=8, rows=2)[0].items()}
  assert (batch["targets_segmentation"] == 0).any(), "the test needs a padded row"
  model = models.Transformer(cfg)
  params = model.init({"params": jax.random.key(0)}, *models.init_inputs(1, 8))["params"]
  loss, aux = lm_lib.loss_fn(model, params, batch, jax.random.key(0), deterministic=True)
  tokens = aux["tokens"]
  garbage = dict(batch, targets=np.where(batch["targets_segmentation"] == 0, 255, batch["targets"]))
  loss_garbage, _ = lm_lib.loss_fn(model, params, garbage, jax.random.key(0), deterministic=True)
  assert int(tokens) == int((batch["targets_segmentation"] != 0).sum())
  np.testing.assert_array_equal(loss, loss_garbage)


def test_same_seed_same_batches_and_process_shards_are_disjoint_and_cover():
  documents = [f"document {i} ".encode() * (1 + i % 4) for i in range(40)]
  first, again = _pack(documents, shuffle=True, seed=3), _pack(documents, shuffle=True, seed=3)
  for a, b in zip(first, again, strict=True):
    for key in a:
      np.testing.assert_array_equal(a[key], b[key])
  assert any((a["inputs"] != b["inputs"]).any() for a, b in zip(first, _pack(documents, shuffle=True, seed=4), strict=False))

  def starts(process_index):  # The first piece of each document a process reads: its first 8 bytes.
    batches = _pack(documents, length=64, rows=1, process_index=process_index, process_count=2, shuffle=True)
    return [bytes(inputs[:8]) for inputs, _ in _pieces(batches)]

  shard0, shard1 = starts(0), starts(1)
  assert len(shard0) == len(shard1) == 20
  everything = sorted(shard0 + shard1)
  assert everything == sorted(d[:8] for d in documents)


# ------------------------------------------------------------------------------------------ end to end
def _english(n: int) -> list[str]:
  """Deterministic English documents from the docstrings of Python's standard library."""
  import argparse
  import collections
  import json as json_module
  import logging
  import subprocess as subprocess_module
  import textwrap

  texts = []
  for module in (argparse, collections, json_module, logging, subprocess_module, textwrap, os, time):
    for name in sorted(dir(module)):
      doc = getattr(getattr(module, name), "__doc__", None)
      if isinstance(doc, str) and len(doc) > 200:
        texts.append(doc)
  return (texts * (n // len(texts) + 1))[:n]


@pytest.fixture(scope="module")
def text_data(tmp_path_factory):
  """ArrayRecord train/eval files of English documents and a SentencePiece model trained on them."""
  from array_record.python.array_record_module import ArrayRecordWriter

  root = tmp_path_factory.mktemp("text")
  documents = _english(600)
  for split, docs in (("train", documents[:540]), ("eval", documents[540:])):
    os.makedirs(root / split)
    for shard in range(2):
      writer = ArrayRecordWriter(str(root / split / f"data.array_record-{shard:05d}-of-00002"), "group_size:1")
      for doc in docs[shard::2]:
        writer.write(doc.encode("utf-8"))
      writer.close()
  train_tokenizer.train(documents, vocab_size=400, output=str(root / "tok.model"))
  return root


def _grain_args(root, *extra):
  return overrides_of(
    "dataset_type=grain",
    f"grain_train_files={root}/train/*",
    f"grain_eval_files={root}/eval/*",
    f"tokenizer_path={root}/tok.model",
    "vocab_size=512",
    "override_model_config=true",
    "max_target_length=64",
    "per_device_batch_size=2",
    *extra,
  )


def _run(tmp_path, *args, wait=True):
  cmd = [sys.executable, "MaxText/train.py", BASE_YML, *args, f"base_output_directory={tmp_path}/out"]
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  if not wait:
    log = open(f"{tmp_path}/background.log", "w", encoding="utf-8")  # noqa: SIM115 (closed by the caller's wait)
    return subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
  proc = run(cmd, env)
  return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.slow
def test_grain_kill_9_and_resume_sees_the_same_batches(tmp_path, text_data):
  run = ("steps=60", "checkpoint_period=10", "log_period=1", "enable_checkpointing=true", "eval_interval=30")
  rc, _, err = _run(tmp_path, *_grain_args(text_data, "run_name=straight", *run, f"metrics_file={tmp_path}/s.jsonl"))
  assert rc == 0, err
  straight = metrics_losses(tmp_path / "s.jsonl")
  assert sorted(straight) == list(range(60))

  args = _grain_args(text_data, "run_name=killed", *run, f"metrics_file={tmp_path}/k.jsonl")
  proc = _run(tmp_path, *args, wait=False)
  deadline = time.time() + 180
  while time.time() < deadline and not (tmp_path / "out/killed/checkpoints/20").is_dir() and proc.poll() is None:
    time.sleep(0.01)
  os.kill(proc.pid, signal.SIGKILL)
  proc.wait()
  killed_at = len(metrics_losses(tmp_path / "k.jsonl"))
  assert killed_at < 60, "the run finished before it was killed"

  rc, out, err = _run(tmp_path, *args)
  assert rc == 0, err
  assert "resumed from" in out
  resumed = metrics_losses(tmp_path / "k.jsonl")
  assert sorted(resumed) == list(range(60))
  for step, loss in resumed.items():
    assert loss == straight[step], f"step {step}: {loss} != {straight[step]} after resume"
  evals = [m for m in map(json.loads, open(tmp_path / "s.jsonl", encoding="utf-8")) if "eval/avg_loss" in m]
  assert [m["step"] for m in evals] == [29, 59]
  assert evals[1]["eval/avg_loss"] < evals[0]["eval/avg_loss"]
  assert evals[1]["eval/perplexity"] == pytest.approx(np.exp(evals[1]["eval/avg_loss"]), rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(
  "change, message",
  [
    ("grain_train_files={root}/nothing/*", "grain_train_files={root}/nothing/* matches no files"),
    ("grain_train_files=", "grain_train_files is empty"),
    ("tokenizer_path={root}/missing.model", "tokenizer_path={root}/missing.model does not exist"),
    ("vocab_size=256", "has 400 tokens but vocab_size=256"),
    ("dataset_type=tfds", "dataset_type=tfds needs dataset_name"),
  ],
)
def test_bad_data_input_exits_2_with_one_line_and_writes_nothing(tmp_path, text_data, change, message):
  change, message = change.format(root=text_data), message.format(root=text_data)
  rc, out, err = _run(tmp_path, *_grain_args(text_data, "run_name=bad", "steps=2", change))
  assert rc == 2, (out, err)
  assert err.count("\n") == 1 and message in err, err
  assert not os.path.exists(tmp_path / "out")


def _first_batch(cfg):
  import jax

  from MaxText import input_pipeline, objectives, sharding

  mesh = sharding.create_mesh(cfg, jax.devices()[:1])
  examples = objectives.get(cfg).examples  # What the run's objective reads its records as (train.py's way).
  input_pipeline.check(cfg, examples)
  return {k: np.asarray(v) for k, v in next(input_pipeline.create_iterator(cfg, mesh, examples=examples)).items()}


@pytest.mark.slow
def test_grain_tfds_and_hf_sources_give_the_same_batches(tmp_path, text_data):
  """The demo corpus read as ArrayRecord files, as a TFDS data source and as Hugging Face json lines."""
  from MaxText import build_demo_dataset

  build_demo_dataset.build(str(tmp_path / "demo"), max_documents=40, include_debian=False)
  texts = []
  from array_record.python.array_record_module import ArrayRecordReader

  for path in sorted((tmp_path / "demo/array_record/train").iterdir()):
    reader = ArrayRecordReader(str(path))
    texts += [r.decode("utf-8") for r in reader.read_all()]
    reader.close()
  with open(tmp_path / "train.jsonl", "w", encoding="utf-8") as f:
    f.writelines(json.dumps({"text": t}) + "\n" for t in texts)

  common = (f"tokenizer_path={text_data}/tok.model", "vocab_size=512", "override_model_config=true")
  common += ("max_target_length=64", "per_device_batch_size=4")
  grain_cfg = config("dataset_type=grain", f"grain_train_files={tmp_path}/demo/array_record/train/*", *common)
  tfds_cfg = config("dataset_type=tfds", f"dataset_path={tmp_path}/demo/tfds", "dataset_name=demo_corpus", *common)
  hf_cfg = config("dataset_type=hf", "hf_path=json", f"hf_train_files={tmp_path}/train.jsonl", *common)
  reference = _first_batch(grain_cfg)
  assert reference["inputs_segmentation"].max() >= 1
  for cfg in (tfds_cfg, hf_cfg):
    batch = _first_batch(cfg)
    for key, value in reference.items():
      np.testing.assert_array_equal(batch[key], value, err_msg=f"{cfg.dataset_type}: {key}")
  for cfg in (grain_cfg, tfds_cfg, hf_cfg):
    _assert_resumes_exactly(cfg)


def _assert_resumes_exactly(cfg, after=3):
  """A fresh iterator set to the state saved after `after` batches yields what the first one yields next."""
  import jax

  from MaxText import input_pipeline, objectives, sharding

  mesh = sharding.create_mesh(cfg, jax.devices()[:1])
  examples = objectives.get(cfg).examples
  first = input_pipeline.create_iterator(cfg, mesh, examples=examples)
  for _ in range(after):
    next(first)
  state = json.loads(json.dumps(first.get_state()))  # As a checkpoint stores it.
  expected = [jax.device_get(next(first)) for _ in range(2)]
  second = input_pipeline.create_iterator(cfg, mesh, examples=examples)
  second.set_state(state)
  for want in expected:
    got = jax.device_get(next(second))
    for key in want:
      np.testing.assert_array_equal(got[key], want[key], err_msg=f"{cfg.dataset_type}: {key}")


@pytest.mark.slow
def test_resume_without_this_process_data_state_exits_2(tmp_path, text_data):
  args = _grain_args(text_data, "run_name=r", "steps=2", "checkpoint_period=2", "enable_checkpointing=true")
  rc, _, err = _run(tmp_path, *args)
  assert rc == 0, err
  data = tmp_path / "out/r/checkpoints/2/data"
  (data / "process_0-of-1.json").rename(data / "process_0-of-2.json")  # As if saved by 2 processes.
  rc, out, err = _run(tmp_path, *_grain_args(text_data, "run_name=r", "steps=4", "enable_checkpointing=true"))
  assert rc == 2, (out, err)
  assert err.count("\n") == 1 and "has no data state for process 0 of 1" in err, err
  assert sorted(p.name for p in (tmp_path / "out/r/checkpoints").iterdir()) == ["2"]


def test_documents_of_which_none_has_a_target_are_one_error_not_a_spin():
  """Documents of fewer than two tokens yield nothing: repeated forever they would be read without end."""
  from MaxText.common_types import ConfigError
  from MaxText.tests.helpers import deadline

  with deadline(30), pytest.raises(ConfigError, match="no document of the data has two tokens or more"):
    _pack([b"", b"x", b""], num_epochs=-1)
  with deadline(30):  # one document with a target among them: batches come, forever
    batches = text_pipeline.make_dataset([b"", b"x", b"xy"], tokenize=ByteTokens(), length=8, rows=2, seed=0,
                                         num_epochs=-1, process_index=0, process_count=1)  # fmt: skip
    pieces = _pieces([next(iter(batches))])
  assert pieces and all(piece == ([ord("x")], [ord("y")]) for piece in pieces)
  with pytest.raises(ConfigError, match="holds no records for process 2 of 3"):
    _pack([b"ab", b"cd"], process_index=2, process_count=3)


def _hf_text_config(files, path, *extra):  # noqa: F811
  return config("dataset_type=hf", "hf_path=json", f"hf_train_files={path}", "tokenizer_type=huggingface",
                f"tokenizer_path={files}/hf/tokenizer.json", "vocab_size=512", "override_model_config=true",
                "per_device_batch_size=2", *extra)  # fmt: skip


@pytest.mark.parametrize(
  "lines, extra, message",
  [
    ([{"text": ""}] * 3, ("add_bos=false", "add_eos=false"), "no document of hf_train_files={path} has two tokens"),
    ([{"body": "a b"}] * 3, (), "train_data_columns=['text']: a record has no column 'text' (it has ['body'])"),
    ([{"text": 5}] * 3, (), "a document is a int, not text"),
  ],
  ids=["empty", "no-column", "not-text"],
)
def test_documents_check_reads_until_one_fits(files, tmp_path, lines, extra, message):  # noqa: F811
  from MaxText.common_types import ConfigError
  from MaxText.tests.sft_test import _first_batch_or_error

  path = tmp_path / "docs.jsonl"
  path.write_text("".join(json.dumps(line) + "\n" for line in lines))
  with pytest.raises(ConfigError) as error:
    _first_batch_or_error(_hf_text_config(files, path, *extra))
  assert message.format(path=path) in str(error.value)


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "socket"])
def test_data_files_that_are_not_regular_files_are_never_opened(tmp_path, kind):
  import socket

  from MaxText import input_pipeline
  from MaxText.common_types import ConfigError
  from MaxText.tests.helpers import deadline

  path = str(tmp_path / "data.array_record")
  if kind == "fifo":
    os.mkfifo(path)
  elif kind == "socket":
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
  else:
    path = "/dev/zero"
  words = {"fifo": "a FIFO", "dev-zero": "a character device", "socket": "a socket"}[kind]
  cfg = config("dataset_type=grain", f"grain_train_files={path}", f"tokenizer_path={tmp_path}/none.model")
  with deadline(30), pytest.raises(ConfigError, match=re.escape(f"{path} is not a regular file (it is {words})")):
    input_pipeline._files("grain_train_files", cfg.grain_train_files)
  hf = config("dataset_type=hf", f"hf_path={path}", f"tokenizer_path={tmp_path}/none.model")
  with deadline(30), pytest.raises(ConfigError, match=re.escape(f"hf_path={path} is not a regular file (it is {words})")):
    input_pipeline._hf_source(hf, train=True)
