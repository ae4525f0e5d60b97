"""Context parallelism: sequences split over 2, 4 and 8 devices give the attention, losses and gradients of one.

Kernels are compared with the reference `dot_product_attention` on the same float32 inputs at HIGHEST precision,
as in attention_kernels_test (packed documents with padding, sliding windows, soft caps, GQA), splash (TPU's flash)
in Pallas interpret mode; the model with the same loss on one device without a mesh.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from MaxText import sharding
from MaxText.common_types import ConfigError
from MaxText.layers import context_parallel as cp
from MaxText.layers import models
from MaxText.layers.attention_kernels import AttentionSettings
from MaxText.tests.attention_kernels_test import (
  _assert_all_close,
  _assert_close,
  _inputs,
  _out_and_all_grads,
  _out_and_grads,
  _reference,
  _settings_reference,
  _sinks,
)
from MaxText.tests.helpers import assert_mesh_loss_and_grads_equal, config, train_batch

LENGTH = 64


def _mesh_config(degree, *args):
  cfg = config(
    f"ici_context_parallelism={degree}",
    "ici_fsdp_parallelism=-1",
    "per_device_batch_size=1",
    f"max_target_length={LENGTH}",
    "sa_block_q=8",
    "sa_block_kv=4",
    *args,
    num_devices=8,
  )
  return cfg, sharding.create_mesh(cfg, jax.devices())


# (degree, strategy, kernel, load balance, window, cap): every degree with each strategy, balanced and not, with
# and without windows and caps.
CASES = [
  (2, "all_gather", "dot_product", True, 0, 0.0),
  (4, "all_gather", "flash", False, 9, 0.0),
  (8, "all_gather", "flash", True, 9, 5.0),
  (8, "all_gather", "dot_product", False, 9, 5.0),
  (2, "ring", "flash", False, 0, 5.0),
  (4, "ring", "flash", True, 9, 0.0),
  (8, "ring", "flash", True, 0, 0.0),
  (8, "ring", "flash", False, 9, 0.0),
]


@pytest.mark.parametrize("degree,strategy,kernel,balanced,window,cap", CASES)
@pytest.mark.mesh
def test_split_attention_equals_the_reference(degree, strategy, kernel, balanced, window, cap):
  """Row 0 packs documents of 10, 15 and 20 tokens then padding; inputs in load-balanced order when balanced."""
  cfg, mesh = _mesh_config(
    degree,
    f"context_parallel_strategy={strategy}",
    f"attention={kernel}",
    f"context_parallel_load_balance={str(balanced).lower()}",
  )
  q, k, v, w, seg, pos = _inputs(4, LENGTH, 4, 2, docs=(10, 15, 20))
  order = cp.load_balanced_order(LENGTH, degree) if balanced else np.arange(LENGTH)

  def split(q, k, v, seg, pos):
    return cp.attend(q, k, v, seg, pos, AttentionSettings.from_config(cfg, window=window, cap=cap), mesh=mesh)

  got = _out_and_grads(split, *(x[:, order] for x in (q, k, v, w, seg, pos)))
  want = _out_and_grads(_reference(window, cap), q, k, v, w, seg, pos)
  _assert_close(got, jax.tree_util.tree_map(lambda x: x[:, order], want))


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
@pytest.mark.parametrize(
  "axes", [("ici_context_parallelism=4",), ("ici_sequence_parallelism=2", "ici_context_parallelism=2")]
)
@pytest.mark.mesh
def test_pieces_that_are_no_multiple_of_the_blocks(strategy, axes):
  """Length 48 over 4 devices, balanced: each device holds two chunks of 6 tokens, far apart, in blocks of 8 (padded
  at the end of each piece); over one axis or over sequence x context."""
  cfg, mesh = _mesh_config(4, *axes, "max_target_length=48", f"context_parallel_strategy={strategy}", "attention=flash")
  q, k, v, w, seg, pos = _inputs(4, 48, 4, 2, docs=(10, 15, 20))
  order = cp.load_balanced_order(48, 4)

  def split(q, k, v, seg, pos):
    return cp.attend(q, k, v, seg, pos, AttentionSettings.from_config(cfg, window=9), mesh=mesh)

  got = _out_and_grads(split, *(x[:, order] for x in (q, k, v, w, seg, pos)))
  want = _out_and_grads(_reference(9), q, k, v, w, seg, pos)
  _assert_close(got, jax.tree_util.tree_map(lambda x: x[:, order], want))


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
@pytest.mark.mesh
def test_split_attention_with_tensor_parallel_heads_and_a_traced_window(strategy):
  """context=4 x tensor=2 with one kv head (repeated to each device's query heads); the window is traced, as in
  Gemma 2's scan over local and global layers."""
  cfg, mesh = _mesh_config(4, "ici_tensor_parallelism=2", f"context_parallel_strategy={strategy}", "attention=flash")
  q, k, v, w, seg, pos = _inputs(4, LENGTH, 4, 1, docs=(10, 15, 20))
  order = cp.load_balanced_order(LENGTH, 4)

  def split(q, k, v, seg, pos, window):
    return cp.attend(q, k, v, seg, pos, AttentionSettings.from_config(cfg, window=window), mesh=mesh)

  for window in (0, 9):
    got = _out_and_grads(split, *(x[:, order] for x in (q, k, v, w, seg, pos)), jnp.int32(window))
    want = _out_and_grads(_reference(window), q, k, v, w, seg, pos)
    _assert_close(got, jax.tree_util.tree_map(lambda x: x[:, order], want))


# (strategy, kernel, load balance, tensor, window, chunk, chunk traced): 4 devices of context with gpt-oss's sinks and
# Llama 4's chunks (12 tokens: chunks cross the devices' pieces of 16, and the balanced halves of 8), a window
# inside the chunk, heads split over tensor (each device then holds its heads' sinks).
CHUNK_CASES = [
  ("all_gather", "flash", True, 1, 0, 12, False),
  ("all_gather", "dot_product", False, 2, 5, 12, True),
  ("ring", "flash", True, 2, 5, 12, False),
  ("ring", "flash", False, 1, 0, 7, True),
]


@pytest.mark.parametrize("strategy,kernel,balanced,tensor,window,chunk,traced", CHUNK_CASES)
@pytest.mark.mesh
def test_split_attention_with_chunks_and_sinks_equals_the_reference(
  strategy, kernel, balanced, tensor, window, chunk, traced
):
  """Output and the gradients of q, k, v and the sinks (summed over the devices' queries) equal one device's
  reference; row 0 packs documents of 10, 15 and 20 tokens then padding, so chunks restart mid-piece."""
  cfg, mesh = _mesh_config(
    4,
    f"ici_tensor_parallelism={tensor}",
    f"context_parallel_strategy={strategy}",
    f"attention={kernel}",
    f"context_parallel_load_balance={str(balanced).lower()}",
  )
  q, k, v, w, seg, pos = _inputs(4, LENGTH, 4, 2, docs=(10, 15, 20))
  sinks = _sinks(4)
  order = cp.load_balanced_order(LENGTH, 4) if balanced else np.arange(LENGTH)

  def split(q, k, v, sinks, seg, pos, chunk=chunk):
    settings = AttentionSettings.from_config(cfg, window=window, chunk=chunk, sinks=sinks)
    return cp.attend(q, k, v, seg, pos, settings, mesh=mesh)

  args = (*(x[:, order] for x in (q, k, v)), sinks, w[:, order], seg[:, order], pos[:, order])
  got = _out_and_all_grads(split, *args, *([jnp.int32(chunk)] if traced else []))
  want = _out_and_all_grads(_settings_reference(window, chunk), q, k, v, sinks, w, seg, pos)
  out, (dq, dk, dv, d_sinks) = want
  _assert_all_close(got, (out[:, order], (dq[:, order], dk[:, order], dv[:, order], d_sinks)))


# Splash (TPU's flash kernel) under context parallelism, in Pallas interpret mode: mostly pieces of 128 tokens
# (splash's lanes) in 128-token tiles, so a load-balanced piece's two chunks of 64 share a tile; pieces of two tiles
# (test_splash_with_pieces_of_two_tiles) give ring steps whose mask leaves a whole query tile without keys. No query
# sums over more than 256 keys (a causal mask at 256 tokens, or a window) except there (512, causal), near the regime
# attention_kernels_test's tolerances are measured in.
SPLASH_BLOCKS = [f"{name}=128" for name in ("sa_block_q", "sa_block_kv", "sa_block_kv_compute", "sa_block_q_dkv")]
SPLASH_BLOCKS += [
  f"{name}=128" for name in ("sa_block_kv_dkv", "sa_block_kv_dkv_compute", "sa_block_q_dq", "sa_block_kv_dq")
]


def _splash_config(degree, *args):
  return _mesh_config(degree, f"max_target_length={128 * degree}", "attention=flash", *SPLASH_BLOCKS, *args)


def _runs_splash(attention, *args) -> bool:
  """Whether the traced program holds a Pallas kernel (splash), not only blockwise attention's plain JAX."""
  return "pallas_call" in str(jax.make_jaxpr(attention)(*args))


# (degree, strategy, load balance, kv heads, window, cap, fused backward): each strategy balanced and not, MQA and
# GQA, a window within a piece and one across pieces (150 > 128), soft caps, both splash backwards.
SPLASH_CASES = [
  (2, "all_gather", False, 2, 0, 0.0, False),
  (4, "all_gather", True, 1, 40, 3.0, True),
  (2, "ring", False, 2, 0, 0.0, True),
  (4, "ring", True, 2, 40, 3.0, False),
  (4, "ring", False, 1, 150, 0.0, False),
]


@pytest.mark.parametrize("degree,strategy,balanced,kv_heads,window,cap,fused", SPLASH_CASES)
@pytest.mark.mesh
def test_splash_split_attention_equals_the_reference(degree, strategy, balanced, kv_heads, window, cap, fused):
  """Splash runs (a Pallas kernel in the program) and equals the reference; row 0 packs documents of 100, 30 and
  106 tokens then padding, across the pieces."""
  cfg, mesh = _splash_config(
    degree,
    f"context_parallel_strategy={strategy}",
    f"context_parallel_load_balance={str(balanced).lower()}",
    f"sa_use_fused_bwd_kernel={str(fused).lower()}",
  )
  length = 128 * degree
  q, k, v, w, seg, pos = _inputs(4, length, 4, kv_heads, docs=(100, 30, 106))
  order = cp.load_balanced_order(length, degree) if balanced else np.arange(length)

  def split(q, k, v, seg, pos):
    settings = AttentionSettings.from_config(cfg, window=window, cap=cap, interpret=True)
    return cp.attend(q, k, v, seg, pos, settings, mesh=mesh)

  args = [x[:, order] for x in (q, k, v, w, seg, pos)]
  assert _runs_splash(split, *args[:3], *args[4:])
  got = _out_and_grads(split, *args)
  want = _out_and_grads(_reference(window, cap), q, k, v, w, seg, pos)
  _assert_close(got, jax.tree_util.tree_map(lambda x: x[:, order], want))


# (strategy, load balance, window) over 2 devices of 256 tokens, two 128-token query tiles each: the balanced ring's
# step with keys from the higher rank (the queries' first chunk, a whole tile, sees none of them) and an unbalanced
# ring whose window (100) is shorter than the piece (the second tile sees no key of the previous piece); splash
# leaves such a tile untouched, which must not reach the merge as NaN. all_gather's pieces never have one.
@pytest.mark.parametrize("strategy,balanced,window", [("ring", True, 0), ("ring", False, 100), ("all_gather", True, 0)])
@pytest.mark.mesh
def test_splash_with_pieces_of_two_tiles(strategy, balanced, window):
  cfg, mesh = _mesh_config(
    2,
    "max_target_length=512",
    "attention=flash",
    *SPLASH_BLOCKS,
    f"context_parallel_strategy={strategy}",
    f"context_parallel_load_balance={str(balanced).lower()}",
  )
  q, k, v, w, seg, pos = _inputs(4, 512, 4, 2, docs=(200, 60, 230))
  order = cp.load_balanced_order(512, 2) if balanced else np.arange(512)

  def split(q, k, v, seg, pos):
    return cp.attend(q, k, v, seg, pos, AttentionSettings.from_config(cfg, window=window, interpret=True), mesh=mesh)

  args = [x[:, order] for x in (q, k, v, w, seg, pos)]
  assert _runs_splash(split, *args[:3], *args[4:])
  got = _out_and_grads(split, *args)
  want = _out_and_grads(_reference(window), q, k, v, w, seg, pos)
  _assert_close(got, jax.tree_util.tree_map(lambda x: x[:, order], want))


@pytest.mark.mesh
def test_ring_falls_back_to_blockwise_when_splash_backward_changes(monkeypatch):
  """The ring calls splash's private backward by its parameters' names: one whose signature differs (here a jax that
  dropped save_residuals and residual_checkpoint_name) is not called, the ring runs blockwise; all_gather, which does
  not need it, still runs splash."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash

  from MaxText.layers import attention_splash

  def changed(*, mask_value, is_mqa, block_sizes, mask_function, attn_logits_soft_cap, interpret, res, do):
    raise AssertionError("called with a signature it does not have")

  assert attention_splash.splash_backward_available()
  monkeypatch.setattr(splash, "_splash_attention_bwd", changed)
  assert not attention_splash.splash_backward_available()
  q, k, v, _, seg, pos = _inputs(4, 256, 4, 2, docs=(100, 30, 106))
  for strategy in ("ring", "all_gather"):
    cfg, mesh = _splash_config(2, f"context_parallel_strategy={strategy}")

    def split(q, k, v, seg, pos, cfg=cfg, mesh=mesh):
      return cp.attend(q, k, v, seg, pos, AttentionSettings.from_config(cfg, interpret=True), mesh=mesh)

    assert _runs_splash(split, q, k, v, seg, pos) == (strategy == "all_gather")


@pytest.mark.parametrize("strategy,balanced,chunk,traced", [("all_gather", True, 48, True), ("ring", False, 48, False)])
@pytest.mark.mesh
def test_splash_split_attention_with_chunks_sinks_and_tensor_heads(strategy, balanced, chunk, traced):
  """context=4 x tensor=2 (each device holds its heads' sinks), a window of 40 inside Llama 4's chunks of 48 (which
  restart mid-piece with row 0's documents): output and the gradients of q, k, v and the sinks equal the
  reference's, through splash."""
  cfg, mesh = _splash_config(
    4,
    "ici_tensor_parallelism=2",
    f"context_parallel_strategy={strategy}",
    f"context_parallel_load_balance={str(balanced).lower()}",
  )
  q, k, v, w, seg, pos = _inputs(4, 512, 4, 2, docs=(100, 30, 106))
  sinks = _sinks(4)
  order = cp.load_balanced_order(512, 4) if balanced else np.arange(512)

  def split(q, k, v, sinks, seg, pos, chunk=chunk):
    settings = AttentionSettings.from_config(cfg, window=40, chunk=chunk, sinks=sinks, interpret=True)
    return cp.attend(q, k, v, seg, pos, settings, mesh=mesh)

  args = (*(x[:, order] for x in (q, k, v)), sinks, w[:, order], seg[:, order], pos[:, order])
  extra = [jnp.int32(chunk)] if traced else []
  assert _runs_splash(split, *args[:4], *args[5:], *extra)
  got = _out_and_all_grads(split, *args, *extra)
  out, (dq, dk, dv, d_sinks) = _out_and_all_grads(_settings_reference(40, chunk), q, k, v, sinks, w, seg, pos)
  _assert_all_close(got, (out[:, order], (dq[:, order], dk[:, order], dv[:, order], d_sinks)))


# The ring's case (about 15 s: three whole rings, each with its backward) is slow-marked; all_gather's is its fast sibling.
@pytest.mark.parametrize("strategy", ["all_gather", pytest.param("ring", marks=pytest.mark.slow)])
@pytest.mark.mesh
def test_splash_split_attention_with_a_traced_window(strategy, monkeypatch):
  """A traced window (Gemma 2's scan) switches between splash kernels for 0 and config.sliding_window_size, and runs
  today's blockwise path for any other value: all three equal the reference. lax.switch traces every branch, so the
  branch taken is told at run time: the blockwise fallback, wrapped, reports each time it runs."""
  fallback = "_ring" if strategy == "ring" else "_all_gather_attention"
  ran, original = [], getattr(cp, fallback)

  def reporting(*args, **kwargs):
    jax.debug.callback(lambda: ran.append(True))
    return original(*args, **kwargs)

  monkeypatch.setattr(cp, fallback, reporting)
  cfg, mesh = _splash_config(2, f"context_parallel_strategy={strategy}", "sliding_window_size=40")
  q, k, v, w, seg, pos = _inputs(4, 256, 4, 2, docs=(100, 30, 106))
  order = cp.load_balanced_order(256, 2)

  def split(q, k, v, seg, pos, window):
    return cp.attend(q, k, v, seg, pos, AttentionSettings.from_config(cfg, window=window, interpret=True), mesh=mesh)

  for window in (40, 0, 24):
    ran.clear()
    got = _out_and_grads(split, *(x[:, order] for x in (q, k, v, w, seg, pos)), jnp.int32(window))
    jax.effects_barrier()
    assert bool(ran) == (window == 24), (window, len(ran))
    want = _out_and_grads(_reference(window), q, k, v, w, seg, pos)
    _assert_close(got, jax.tree_util.tree_map(lambda x: x[:, order], want))


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
@pytest.mark.mesh
def test_splash_over_sequence_and_context_axes(strategy):
  """sequence=2 x context=2, balanced: the devices' order along both axes is the order of the queries' block tables
  (all_gather) and of the ring."""
  cfg, mesh = _splash_config(
    4, "ici_sequence_parallelism=2", "ici_context_parallelism=2", f"context_parallel_strategy={strategy}"
  )
  q, k, v, w, seg, pos = _inputs(4, 512, 4, 2, docs=(100, 30, 106))
  order = cp.load_balanced_order(512, 4)

  def split(q, k, v, seg, pos):
    return cp.attend(q, k, v, seg, pos, AttentionSettings.from_config(cfg, window=40, interpret=True), mesh=mesh)

  got = _out_and_grads(split, *(x[:, order] for x in (q, k, v, w, seg, pos)))
  want = _out_and_grads(_reference(40), q, k, v, w, seg, pos)
  _assert_close(got, jax.tree_util.tree_map(lambda x: x[:, order], want))


@pytest.mark.parametrize("strategy", ["all_gather", "ring"])
@pytest.mark.mesh
def test_pieces_that_do_not_fit_splash_fall_back_to_blockwise(strategy):
  """Pieces of 16 tokens (no multiple of splash's 128 lanes): the blockwise path runs (no Pallas kernel) and equals
  the reference."""
  cfg, mesh = _mesh_config(4, "attention=flash", f"context_parallel_strategy={strategy}")
  q, k, v, w, seg, pos = _inputs(4, LENGTH, 4, 2, docs=(10, 15, 20))
  order = cp.load_balanced_order(LENGTH, 4)

  def split(q, k, v, seg, pos):
    return cp.attend(q, k, v, seg, pos, AttentionSettings.from_config(cfg, window=9, interpret=True), mesh=mesh)

  args = [x[:, order] for x in (q, k, v, w, seg, pos)]
  assert not _runs_splash(split, *args[:3], *args[4:])
  got = _out_and_grads(split, *args)
  want = _out_and_grads(_reference(9), q, k, v, w, seg, pos)
  _assert_close(got, jax.tree_util.tree_map(lambda x: x[:, order], want))


@pytest.mark.parametrize("degree", [2, 4, 8])
@pytest.mark.mesh
def test_reorder_is_the_load_balanced_order_and_its_inverse_undoes_it(degree):
  cfg, mesh = _mesh_config(degree, "ici_tensor_parallelism=2" if degree < 8 else "ici_tensor_parallelism=1")
  x = jnp.arange(4 * LENGTH * 6, dtype=jnp.float32).reshape(4, LENGTH, 6)
  axes = ("activation_batch", "activation_length", "activation_embed")
  balanced = jax.jit(lambda x: cp.reorder(x, axes, cfg, mesh))(x)
  order = cp.load_balanced_order(LENGTH, degree)
  np.testing.assert_array_equal(balanced, x[:, order])
  np.testing.assert_array_equal(jax.jit(lambda x: cp.reorder(x, axes, cfg, mesh, inverse=True))(balanced), x)
  # Under a causal mask query i attends to i + 1 keys: every device gets the same share of that work.
  work = (order + 1).reshape(degree, -1).sum(axis=1)
  assert len(set(work.tolist())) == 1
  assert sorted(order.tolist()) == list(range(LENGTH))


def _packed_batch(cfg, rows):
  """train_batch with row 0 packing documents of 20 and 30 tokens then padding."""
  batch = train_batch(cfg, rows=rows)
  seg, pos = batch["inputs_segmentation"].copy(), batch["inputs_position"].copy()
  seg[0, :20], seg[0, 20:50], seg[0, 50:] = 1, 2, 0
  pos[0, 20:50] = np.arange(30)
  return {**batch, "inputs_segmentation": seg, "inputs_position": pos, "targets_segmentation": seg}


MODELS = {
  "llama context=2 fsdp=4": ("ici_context_parallelism=2", "ici_fsdp_parallelism=4"),
  "llama context=4 tensor=2 ring": (
    "ici_context_parallelism=4",
    "ici_tensor_parallelism=2",
    "context_parallel_strategy=ring",
  ),
  "mistral window context=8 flash": (
    "ici_context_parallelism=8",
    "override_model_config=true",
    "decoder_block=mistral",
    "sliding_window_size=7",
    "attention=flash",
  ),
  "deepseek mla context=2 expert=2 ring": (
    "model_name=deepseek3-tiny",
    "ici_context_parallelism=2",
    "ici_expert_parallelism=2",
    "context_parallel_strategy=ring",
  ),
}


# DeepSeek's (MLA and experts, 10 s) is slow-marked: the llama ring case is its fast sibling for the ring.
@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if "deepseek" in n else []) for n in MODELS])
@pytest.mark.mesh
def test_model_loss_and_gradients_equal_one_device(name):
  """The summed loss and every gradient of a packed batch; float32 at HIGHEST precision."""
  args = (*MODELS[name], "sa_block_q=8", "sa_block_kv=4", "ici_fsdp_parallelism=-1")
  one = config(*[a for a in args if not a.startswith("ici_")], "per_device_batch_size=4")
  cfg = config(*args, "per_device_batch_size=0.5", num_devices=8)
  batch = _packed_batch(one, rows=4)
  params = models.Transformer(one).init(jax.random.key(0), *models.init_inputs(1, one.max_target_length))["params"]
  assert_mesh_loss_and_grads_equal(one, cfg, params, batch, rtol=1e-5, grad_atol=1e-4)


def test_lengths_that_do_not_split_are_refused_in_one_line():
  with pytest.raises(
    ConfigError, match=r"context_parallel_load_balance: max_target_length=40 does not split into 2 x 8 chunks"
  ):
    config("ici_context_parallelism=8", "max_target_length=40", num_devices=8)
  config("ici_context_parallelism=8", "max_target_length=40", "context_parallel_load_balance=false", num_devices=8)
  with pytest.raises(ConfigError, match="max_target_length=36 does not split over the 8 shards"):
    config("ici_context_parallelism=8", "max_target_length=36", "context_parallel_load_balance=false", num_devices=8)
  with pytest.raises(ConfigError, match="capacity_factor=1.0 drops expert assignments in token order"):
    config(
      "ici_context_parallelism=2",
      "decoder_block=mixtral",
      "num_experts=4",
      "override_model_config=true",
      "capacity_factor=1",
      num_devices=8,
    )
  with pytest.raises(ConfigError, match=r"pipeline parallelism \(2 stages\) with sequences split over"):
    config("ici_context_parallelism=2", "ici_pipeline_parallelism=2", num_devices=8)
  with pytest.raises(
    ConfigError, match="context_parallel_strategy='rings' is not supported; choose one of 'all_gather', 'ring'"
  ):
    config("context_parallel_strategy=rings")
