"""Small shared helpers for the tests."""

import contextlib
import json
import os
import signal
import socket
import subprocess

import jax
import numpy as np
import pytest

from MaxText import pyconfig
from MaxText.objectives import lm as lm_lib

BASE_YML = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "base.yml")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# A tiny float32 model: GQA (4 query heads over 2 KV heads), 2 layers, 64 tokens per row.
TINY = (
  "model_name=tiny",
  "dtype=float32",
  "max_target_length=64",
  "enable_checkpointing=false",
  "enable_tensorboard=false",
  "log_config=false",
  "jax_cache_dir=",
  "matmul_precision=highest",
)


def overrides(*args, **kw) -> list[str]:
  """`key=value` arguments of the tiny test model, later ones replacing earlier ones."""
  values = dict(arg.split("=", 1) for arg in ("run_name=test", *TINY, *args))
  values.update({k: str(v) for k, v in kw.items()})
  return [f"{k}={v}" for k, v in values.items()]


def config(*args, num_devices=1, **kw):
  """A Config of the tiny test model with `key=value` overrides."""
  return pyconfig.load([BASE_YML, *overrides(*args, **kw)], num_devices=num_devices, env={})


def train_batch(cfg, rows=2, seed=1) -> dict:
  """A batch of random tokens for loss_fn / train_step: `rows` unpacked sequences of max_target_length."""
  tokens = np.random.default_rng(seed).integers(0, cfg.vocab_size, (rows, cfg.max_target_length + 1)).astype(np.int32)
  ones = np.ones((rows, cfg.max_target_length), np.int32)
  positions = np.broadcast_to(np.arange(cfg.max_target_length, dtype=np.int32), ones.shape)
  return {"inputs": tokens[:, :-1], "inputs_segmentation": ones, "inputs_position": positions, "targets": tokens[:, 1:],
          "targets_segmentation": ones}  # fmt: skip


def assert_sharded_decode_equals_one_device(one, eight, params, prompts):
  """The engine of config `one` on 1 device and of `eight` on 8 (params placed by its layout) gives the same greedy
  tokens, and the same logprobs of the prompt (echo) and of each generated token with their top 5 (rtol 1e-5), for
  `prompts` (8, one per slot, all generating together); returns the 8-device engine, for the caller to check its
  cache's sharding (`engine.pool`)."""
  from MaxText import sharding, state
  from MaxText.inference import engine as engine_lib
  from MaxText.layers import models

  mesh8 = sharding.create_mesh(eight, jax.devices()[:8])
  _, shardings = state.params_layout(models.Transformer(eight, mesh8), eight, mesh8)
  engine1 = engine_lib.Engine(one, sharding.create_mesh(one, jax.devices()[:1]), params)
  engine8 = engine_lib.Engine(eight, mesh8, jax.device_put(params, shardings))
  n = one.max_target_length - one.max_prefill_predict_length
  requests = [engine_lib.Request(tuple(int(t) for t in p), n, logprobs=5, echo=True) for p in prompts]
  for got, want in zip(engine8.generate(requests), engine1.generate(requests), strict=True):
    assert got.tokens == want.tokens
    for name in ("prompt_logprobs", "logprobs"):
      got_lp, want_lp = ([x for x in getattr(r, name) if x is not None] for r in (got, want))
      assert [[i for i, _ in x.top] for x in got_lp] == [[i for i, _ in x.top] for x in want_lp], name
      np.testing.assert_allclose(
        [[x.logprob] + [lp for _, lp in x.top] for x in got_lp],
        [[x.logprob] + [lp for _, lp in x.top] for x in want_lp],
        rtol=1e-5,
        atol=1e-5,
        err_msg=name,
      )
  return engine8


def assert_mesh_loss_and_grads_equal(one, cfg, params, batch, rtol: float, grad_atol: float):
  """The summed loss_fn of config `one` without a mesh and of `cfg` on all 8 devices (params replicated there), and
  every gradient: the loss within `rtol`, each gradient within grad_atol x the largest of its reference's entries."""
  from MaxText import sharding
  from MaxText.layers import models

  def loss_and_grads(cfg, mesh):
    model = models.Transformer(cfg, mesh)
    placed = (
      params if mesh is None else jax.device_put(params, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    )
    grad = jax.value_and_grad(lambda p, b: lm_lib.loss_fn(model, p, b, jax.random.key(0), True)[0])
    return jax.jit(grad)(placed, batch)

  loss1, grads1 = loss_and_grads(one, None)
  loss8, grads8 = loss_and_grads(cfg, sharding.create_mesh(cfg, jax.devices()))
  np.testing.assert_allclose(loss8, loss1, rtol=rtol)
  for (path, g8), g1 in zip(jax.tree_util.tree_leaves_with_path(grads8), jax.tree_util.tree_leaves(grads1), strict=True):
    scale = float(np.abs(np.asarray(g1)).max()) + 1e-6
    np.testing.assert_allclose(np.asarray(g8), np.asarray(g1), atol=grad_atol * scale, rtol=0, err_msg=str(path))


def run(args, env, timeout=300, cwd=REPO_ROOT) -> subprocess.CompletedProcess:
  """Runs a command to completion, capturing its output as text; never raises for a non-zero exit code."""
  return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False)


def assert_trees_equal(got, want):
  """Same structure, dtypes and bits."""
  assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
  for (path, got_leaf), want_leaf in zip(
    jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves(want), strict=True
  ):
    a, b = np.asarray(got_leaf), np.asarray(want_leaf)
    assert a.dtype == b.dtype, jax.tree_util.keystr(path)
    np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


def free_port() -> int:
  """A TCP port free on loopback now (for a coordinator or an sshd the test starts)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def metrics_losses(path, killed: bool = False) -> dict[int, float]:
  """{step: loss} of a metrics_file (JSON lines). `killed`: the file of a run killed with kill -9, perhaps resumed
  since, so a line cut short is left out; otherwise every line must be whole."""
  return {step: values[0] for step, values in metrics_values(path, ("learning/loss",), killed).items()}


def metrics_values(path, keys: tuple[str, ...], killed: bool = False) -> dict[int, tuple]:
  """{step: the values of `keys`} of each logged step of a metrics_file (`killed` as metrics_losses')."""
  rows = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        rows.append(json.loads(line))
      except ValueError:
        if not killed:
          raise
  return {row["step"]: tuple(row[k] for k in keys) for row in rows if "learning/loss" in row}


def abstract_params(preset: str):
  """(parameters as shapes only, the Config) of model preset `preset`: jax.eval_shape, nothing is allocated."""
  from flax import linen as nn

  from MaxText.layers import models

  cfg = config(f"model_name={preset}", "max_target_length=8", "per_device_batch_size=1")
  shapes = jax.eval_shape(lambda: models.Transformer(cfg).init(jax.random.key(0), *models.init_inputs(1, 8)))
  return nn.meta.unbox(shapes)["params"], cfg


BTREE_NODE_MAGIC = bytes.fromhex("0cdb20de")  # the first bytes of an OCDBT B+tree node (TensorStore's format)


def data_files(step_dir: str) -> list[str]:
  """Every Orbax OCDBT data file of the checkpoint folder `step_dir`: array values and B+tree nodes."""
  files = [os.path.join(r, f) for r, _, names in os.walk(os.path.join(step_dir, "items")) for f in names]
  return [f for f in files if f"{os.sep}d{os.sep}" in f]


def array_files(step_dir: str) -> list[str]:
  """The data files of the checkpoint folder `step_dir` that hold array values, largest first. Not the B+tree
  nodes: the root's are the index, and each process's own are unused once Orbax merged them into the root's, so
  damage to one of those may never be read."""

  def holds_values(path):
    with open(path, "rb") as f:
      return f.read(len(BTREE_NODE_MAGIC)) != BTREE_NODE_MAGIC

  return sorted(filter(holds_values, data_files(step_dir)), key=os.path.getsize, reverse=True)


def flip_a_stored_bit(step_dir: str, name: str) -> None:
  """Flips the lowest bit of the first element of array `name` (e.g. params.decoder_norm.scale) as stored, through
  TensorStore: a corruption Orbax reads back without an error, as another value."""
  import tensorstore as ts

  kvstore = {"driver": "ocdbt", "base": f"file://{os.path.join(step_dir, 'items')}/", "path": f"{name}/"}
  stored = ts.open({"driver": "zarr", "kvstore": kvstore}).result()
  first = (0,) * stored.rank
  value = np.asarray(stored[first].read().result())
  bits = value.view(np.dtype(f"u{value.dtype.itemsize}")) ^ 1
  stored[first].write(bits.view(value.dtype)).result()


class Hung(BaseException):
  """Raised by `deadline` (a BaseException, so no `except Exception` in the code under test swallows it)."""


def bounded_exit(command, seconds: int) -> int | str:
  """command()'s exit code, or what went wrong instead, for a fuzz case to report with the others: "still running
  after N s" past `seconds` (deadline), or the exception it raised (a traceback is a failure too)."""
  try:
    with deadline(seconds):
      return command()
  except Hung:
    return f"still running after {seconds} s"
  except BaseException as e:  # noqa: BLE001 (a traceback is a failure to report with the others)
    return f"{type(e).__name__}: {str(e)[:200]}"


@contextlib.contextmanager
def checkpoint_manager(cfg):
  """checkpointing.create_manager(cfg), its saves finished and closed on exit."""
  from MaxText import checkpointing  # noqa: PLC0415  (helpers stays light for the tests that never checkpoint)

  manager = checkpointing.create_manager(cfg)
  try:
    yield manager
  finally:
    manager.wait_until_finished()
    manager.close()


@contextlib.contextmanager
def deadline(seconds: int):
  """Raises Hung in the block after `seconds` (SIGALRM), so a test of a would-be hang fails instead of hanging."""

  def expire(signum, frame):
    raise Hung(f"still running after {seconds} s: it hangs")

  previous = signal.signal(signal.SIGALRM, expire)
  signal.alarm(seconds)
  try:
    yield
  finally:
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


# A fuzz test's cases in two parts: every SAMPLE_EVERY-th case in the quick loop, the others behind the slow marker
# (the whole suite runs both, so every case still runs in CI).
SAMPLE_EVERY = 6
FUZZ_PARTS = [pytest.param("sample", id="sample"), pytest.param("rest", id="rest", marks=pytest.mark.slow)]


def fuzz_part(cases: list, part: str) -> list:
  """The cases of FUZZ_PARTS' `part`, each with its index in `cases`: [(i, case), ...]."""
  sampled = part == "sample"
  return [(i, case) for i, case in enumerate(cases) if (i % SAMPLE_EVERY == 0) == sampled]


def source_lines_matching(pattern: str, allowed: tuple[str, ...] = ()) -> list[str]:
  """ "path:line" of every line of MaxText/'s modules (the tests aside) that the regular expression `pattern` finds,
  except in the files whose repository paths start with one of `allowed`."""
  import re

  found = re.compile(pattern)
  lines = []
  for folder, dirs, files in os.walk(os.path.join(REPO_ROOT, "MaxText")):
    dirs[:] = sorted(d for d in dirs if d not in ("tests", "__pycache__"))
    for name in sorted(files):
      path = os.path.relpath(os.path.join(folder, name), REPO_ROOT)
      if name.endswith(".py") and not path.startswith(allowed):
        with open(os.path.join(REPO_ROOT, path), encoding="utf-8") as f:
          lines += [f"{path}:{i}" for i, line in enumerate(f, 1) if found.search(line)]
  return lines
