"""The attention kernels' capability table: one row per kernel, the same names as the dispatch, read instead of
kernel-name matches everywhere else, and each row's claims checked against what the kernel does."""

import ast
import dataclasses
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText import compiled_step, config_validate, kernel_capabilities
from MaxText.common_types import ConfigError
from MaxText.kernel_capabilities import AUTOSELECT, AUTOSELECTED, CAPABILITIES, CHOICES, PLATFORMS, Call
from MaxText.layers import attention_kernels as ak
from MaxText.layers.attention_kernels import AttentionSettings
from MaxText.tests.helpers import REPO_ROOT
from MaxText.tests.helpers import config as config_of

PACKAGE = os.path.join(REPO_ROOT, "MaxText")
# The modules that may name kernels: the table itself and the dispatch that maps its names to functions.
NAMING_KERNELS = {
  os.path.join("MaxText", "kernel_capabilities.py"),
  os.path.join("MaxText", "layers", "attention_kernels.py"),
}

# float32 kernels against a float64 NumPy reference: the kernels' sums over <= 48 keys reorder float32 rounding
# (a few 1e-7 relative on O(1) values); attention_kernels_test's forward bound, 2e-6, leaves the same headroom and
# stays far below any masking, scaling, cap or sink error (>= 1e-3).
FWD_ATOL = 2e-6


# ------------------------------------------------------------------------------------------------- the table


def test_every_row_names_the_function_that_runs_its_kernel():
  """A kernel is its module and its row: the row's `runs` is the function attend calls, with the kernels' signature."""
  import inspect

  for name in CAPABILITIES:
    params = list(inspect.signature(ak.runner(name)).parameters)
    assert params == ["q", "k", "v", "segment_ids", "positions", "settings", "mesh"], (name, params)
  assert CHOICES == (AUTOSELECTED, *CAPABILITIES) == ak.KERNELS
  assert tuple(config_validate.choices()["attention"]) == CHOICES
  assert all(name == row.name for name, row in CAPABILITIES.items())


def test_every_row_is_consistent():
  """Platforms, alternatives, fallbacks and tiles name what exists; each platform's autoselection ends with a
  kernel that runs any call there."""
  for name, row in CAPABILITIES.items():
    assert set(row.platforms) <= set(PLATFORMS) and set(row.tiles) <= set(PLATFORMS), name
    assert row.instead and set(row.instead) <= set(CAPABILITIES) - {name}, name
    fallback = CAPABILITIES.get(row.context_parallel_fallback)
    assert row.whole_sequences == (fallback is not None), name
    assert fallback is None or not fallback.whole_sequences, name
    with pytest.raises(dataclasses.FrozenInstanceError):
      row.sinks = not row.sinks
  assert set(AUTOSELECT) == set(PLATFORMS)
  for platform, order in AUTOSELECT.items():
    assert all(CAPABILITIES[kernel].runs_on(platform) for kernel, _ in order), platform
    last = CAPABILITIES[order[-1][0]]
    anything = Call(8191, 1000, "float64", cap=1.0, sinks=True, windowed=True, traced_window=True, chunked=True)
    assert order[-1][1] is None and last.refusal(anything) is None and platform not in last.tiles, platform


def _kernel_name_matches(source: str) -> list[str]:
  """Comparisons with a kernel's name (`x == "flash"`, `x in ("dot_product", ...)`) and prefix or suffix matches
  of one (`x.startswith("cudnn")`) in Python source, as `line: code`."""
  names = set(CHOICES)
  found = []

  def literals(node):
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
      return [s for e in node.elts for s in literals(e)]
    return [node.value] if isinstance(node, ast.Constant) and isinstance(node.value, str) else []

  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Compare):
      hits = [s for operand in (node.left, *node.comparators) for s in literals(operand) if s in names]
    elif (
      isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("startswith", "endswith")
    ):
      hits = [s for arg in node.args for s in literals(arg) if any(n.startswith(s) or n.endswith(s) for n in names)]
    else:
      continue
    if hits:
      found.append(f"{node.lineno}: {ast.unparse(node)}")
  return found


def test_the_name_scan_finds_what_it_forbids():
  source = 'a = x == "flash"\nb = name.startswith("cudnn")\nc = y in ("dot_product", "z")\nd = x == "flashy"\n'
  assert [line.split(":")[0] for line in _kernel_name_matches(source)] == ["1", "2", "3"]


def test_no_module_outside_the_table_and_the_dispatch_matches_a_kernel_name():
  """Capabilities are read from the table: a kernel's name compared anywhere else is a capability written twice."""
  found = {}
  for folder, subfolders, files in os.walk(PACKAGE):
    subfolders[:] = [d for d in subfolders if d not in ("tests", "__pycache__")]
    for file in (f for f in files if f.endswith(".py")):
      path = os.path.join(folder, file)
      relative = os.path.relpath(path, REPO_ROOT)
      with open(path, encoding="utf-8") as f:
        matches = _kernel_name_matches(f.read())
      if relative not in NAMING_KERNELS and matches:
        found[relative] = matches
  assert not found, found


def test_the_table_imports_neither_jax_nor_flax():
  """The config layer reads it while parsing a YAML file; a fresh interpreter shows what importing it loads."""
  code = "import sys, MaxText.kernel_capabilities; print(sorted({m.split('.')[0] for m in sys.modules} & {'jax', 'flax'}))"
  result = subprocess.run(
    [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=True
  )
  assert result.stdout.strip() == "[]", result.stdout + result.stderr


# ------------------------------------------------------------------------------------------ behaviour by row


def _numpy_attention(q, k, v, segment_ids, positions, window=0, cap=0.0, sinks=None):
  """Causal attention within documents in float64, written out: softmax(cap * tanh(q k^T / cap) + mask) v with
  grouped heads, keys at most `window - 1` positions back (0: any), each head's sink logit in the denominator."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  segment_ids, positions = np.asarray(segment_ids), np.asarray(positions)
  b, t, h, _ = q.shape
  group = h // k.shape[2]
  out = np.zeros((b, t, h, v.shape[3]))
  for row in range(b):
    seg, pos = segment_ids[row], positions[row]
    visible = (seg[:, None] == seg[None, :]) & (np.arange(t)[:, None] >= np.arange(t)[None, :])
    if window > 0:
      visible &= pos[:, None] - pos[None, :] < window
    for head in range(h):
      scores = q[row, :, head] @ k[row, :, head // group].T
      if cap > 0:
        scores = cap * np.tanh(scores / cap)
      scores = np.where(visible, scores, -np.inf)
      top = scores.max(axis=1, keepdims=True)
      if sinks is not None:
        top = np.maximum(top, float(sinks[head]))
      weights = np.exp(scores - top)
      total = weights.sum(axis=1, keepdims=True) + (0.0 if sinks is None else np.exp(float(sinks[head]) - top))
      out[row, :, head] = (weights / total) @ v[row, :, head // group]
  return out


def _tiny_call(length=48):
  """q, k, v, segment ids and positions: GQA (4 query heads over 2 kv heads), row 0 two documents and padding."""
  kq, kk, kv = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(kq, (2, length, 4, 8), jnp.float32) * 0.5
  k = jax.random.normal(kk, (2, length, 2, 8), jnp.float32)
  v = jax.random.normal(kv, (2, length, 2, 8), jnp.float32)
  segment_ids = np.ones((2, length), np.int32)
  segment_ids[0, 20:40], segment_ids[0, 40:] = 2, 0
  positions = np.tile(np.arange(length, dtype=np.int32), (2, 1))
  positions[0, 20:40], positions[0, 40:] = np.arange(20), np.arange(length - 40)
  return q, k, v, jnp.asarray(segment_ids), jnp.asarray(positions)


@pytest.mark.parametrize("name", [name for name, row in CAPABILITIES.items() if row.runs_on("cpu")])
def test_every_kernel_that_runs_on_the_cpu_computes_attention(name):
  """Each kernel the table says runs on the CPU, with every feature its row says it takes (a window, a soft cap,
  sinks), gives the float64 reference's output on a tiny packed causal call."""
  row = CAPABILITIES[name]
  cfg = config_of(f"attention={name}")
  features = {"window": 12 if row.windows else 0, "cap": 3.0 if row.soft_cap else 0.0}
  sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0], jnp.float32) if row.sinks else None
  q, k, v, segment_ids, positions = _tiny_call()
  settings = AttentionSettings.from_config(cfg, sinks=sinks, **features)
  got = jax.jit(lambda q, k, v: ak.attend(q, k, v, segment_ids, positions, settings))(q, k, v)
  want = _numpy_attention(q, k, v, segment_ids, positions, sinks=sinks, **features)
  np.testing.assert_allclose(np.asarray(got, np.float64), want, atol=FWD_ATOL, rtol=0)


@pytest.mark.parametrize("name", [name for name, row in CAPABILITIES.items() if not row.runs_on("cpu")])
def test_a_kernel_that_needs_another_platform_is_refused_when_the_config_is_read(name):
  row = CAPABILITIES[name]
  with pytest.raises(ConfigError) as error:
    config_of(f"attention={name}", "hardware=cpu")
  assert str(error.value) == (
    f"attention={name} is {row.title}, for {row.where}; set hardware={row.platforms[0]}, or use attention={row.instead[0]}"
  )


@pytest.mark.parametrize("name", [name for name, row in CAPABILITIES.items() if not row.soft_cap])
def test_a_kernel_without_a_soft_cap_is_refused_one_at_config_time(name):
  row = CAPABILITIES[name]
  hardware = row.platforms[0]
  with pytest.raises(ConfigError) as error:
    config_of(f"attention={name}", f"hardware={hardware}", "dtype=bfloat16", "attn_logits_soft_cap=50.0")
  assert re.fullmatch(
    rf"attention={name}: .*no logit soft cap \(attn_logits_soft_cap=50.0, Gemma 2\); use attention=.*", str(error.value)
  )
  assert "\n" not in str(error.value)


@pytest.mark.parametrize("name", [name for name, row in CAPABILITIES.items() if row.whole_sequences])
def test_a_kernel_of_whole_sequences_is_refused_under_context_parallelism(name):
  row = CAPABILITIES[name]
  args = (f"attention={name}", f"hardware={row.platforms[0]}", "dtype=bfloat16", "ici_context_parallelism=2")
  with pytest.raises(ConfigError, match=rf"attention={name} \({row.family}\) does not run under context parallelism"):
    config_of(*args, "ici_fsdp_parallelism=1", num_devices=2)


def test_the_memory_hint_follows_dense_scores():
  """The step's does-not-fit line suggests a kernel without whole [length, length] scores only for one that has
  them."""
  for name, row in CAPABILITIES.items():
    if not row.runs_on("cpu"):
      continue
    line = compiled_step.does_not_fit_line(None, None, "v4", config_of(f"attention={name}", "remat_policy=full"))
    assert (f"attention={row.instead[0]}" in line) == row.dense_scores, (name, line)


def test_refusals_name_the_first_missing_capability():
  """A row's refusal is read from its fields, in a fixed order; a row that takes everything refuses nothing."""
  strict = kernel_capabilities.KernelCapabilities(
    name="strict",
    runs="",
    title="Strict",
    family="S",
    sinks=False,
    soft_cap=False,
    dtypes=("bfloat16",),
    head_dim_multiple=8,
  )
  assert strict.refusal(Call(64, 64, "bfloat16")) is None
  assert strict.refusal(Call(64, 64, "bfloat16", sinks=True, cap=1.0)).startswith("Strict has no attention sinks")
  assert strict.refusal(Call(64, 64, "bfloat16", cap=1.0)).startswith("Strict has no logit soft cap")
  assert strict.refusal(Call(64, 60, "float32")) == "Strict needs bfloat16 inputs, not float32 (set dtype=bfloat16)"
  assert strict.refusal(Call(64, 60, "bfloat16")) == "Strict needs head_dim a multiple of 8, not 60"
  cudnn = CAPABILITIES["cudnn_flash_jax"]
  assert cudnn.head_dim_bound(None) == 256 and cudnn.head_dim_bound((8, 0)) == 128 and cudnn.head_dim_bound((9, 0)) == 256
