"""The mixture-of-experts block (layers/moe.py): every way of running the experts against a reference that runs
every expert on every token, exact capacity drops, the load-balancing loss, and MoE models in training."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from MaxText import families, metrics, train
from MaxText.common_types import ConfigError
from MaxText.layers import models, moe
from MaxText.objectives import lm as lm_lib
from MaxText.tests.helpers import config, train_batch

# A tiny Mixtral: 4 experts, top-2, experts 48 wide; float32 with exact matmuls (helpers.TINY).
MOE = (
  "decoder_block=mixtral",
  "override_model_config=true",
  "num_experts=4",
  "num_experts_per_tok=2",
  "base_moe_mlp_dim=48",
  "load_balance_loss_weight=0.01",
)


def _runs_the_tiny_mixtral_config(name: str) -> bool:
  """Whether family `name` accepts MOE's softmax top-2 router (Llama 4's family, top-1 sigmoid routing with a shared
  expert, refuses it; its MoE is tested in llama4_test.py)."""
  try:
    config(*MOE, f"decoder_block={name}")
  except ConfigError as e:
    if "routed_score_func" not in str(e):  # any other refusal is a bug of the family, not a reason to skip it
      raise
    return False
  return True


# The registry's mixture-of-experts families whose every layer is one stack of MoE layers with a softmax router
# (Mixtral's and Qwen3-MoE's kind; DeepSeek's dense stack, MLA and shared experts have tests of their own in
# deepseek_test.py).
ONE_STACK_MOE = sorted(
  name
  for name, family in families.FAMILIES.items()
  if family.moe and not family.dense_layers and _runs_the_tiny_mixtral_config(name)
)


def _block(cfg, renormalize=True, batch=2, seed=0):
  """(MoeBlock, its params, an input [batch, max_target_length, emb]) with random weights."""
  block = moe.MoeBlock(cfg, renormalize=renormalize)
  x = jax.random.normal(jax.random.key(seed + 1), (batch, cfg.max_target_length, cfg.emb_dim), jnp.float32)
  params = nn.meta.unbox(block.init(jax.random.key(seed), x))["params"]
  # A router with a spread of scores (its init scale makes near-ties between experts too likely to test top-k).
  params["gate"]["kernel"] = 3.0 * jax.random.normal(jax.random.key(seed + 2), params["gate"]["kernel"].shape)
  return block, params, x


def _reference(cfg, params, x, renormalize, keep=None):
  """Every expert on every token, weighted by the router (zero for the experts not chosen): plain jnp, top-k by
  argsort. keep [batch, length, k] (bool) drops assignments as a capacity would."""
  b, s, _ = x.shape
  probs = jax.nn.softmax(jnp.einsum("bse,en->bsn", x, params["gate"]["kernel"]), axis=-1)
  chosen = jnp.argsort(-probs, axis=-1)[..., : cfg.num_experts_per_tok]  # [b, s, k]
  top = jnp.take_along_axis(probs, chosen, axis=-1)
  if renormalize:
    top = top / jnp.sum(top, axis=-1, keepdims=True)
  if keep is not None:
    top = top * keep
  weights = jnp.zeros_like(probs).at[jnp.arange(b)[:, None, None], jnp.arange(s)[None, :, None], chosen].set(top)
  out = 0.0
  for e in range(cfg.num_experts):
    h = jax.nn.silu(x @ params["wi_0"][e]) * (x @ params["wi_1"][e])
    out = out + weights[..., e : e + 1] * (h @ params["wo"][e])
  return out * cfg.routed_scaling_factor, np.asarray(chosen)


def _assert_close_with_grads(cfg, block, params, x, reference):
  got, got_grads = jax.value_and_grad(lambda p, x: jnp.sum(jnp.sin(block.apply({"params": p}, x))), (0, 1))(params, x)
  want, want_grads = jax.value_and_grad(lambda p, x: jnp.sum(jnp.sin(reference(p, x))), (0, 1))(params, x)
  np.testing.assert_allclose(block.apply({"params": params}, x), reference(params, x), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for (path, g), w in zip(
    jax.tree_util.tree_leaves_with_path(got_grads), jax.tree_util.tree_leaves(want_grads), strict=True
  ):
    want_grad = np.asarray(w)
    scale = np.abs(want_grad).max()
    np.testing.assert_allclose(g, want_grad, rtol=1e-4, atol=1e-5 * scale, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize(
  "path",
  [("sparse_matmul=true",), ("sparse_matmul=false",), ("capacity_factor=100.0",), ("norm_topk_prob=false",)],
  ids=["dropless", "dense", "huge_capacity", "not_renormalised"],
)
def test_experts_equal_the_every_expert_reference_forward_and_gradients(path):
  """Dropless (ragged_dot over sorted tokens), dense, and capacity too large to drop anything: the same outputs and
  gradients (of the input and every weight) as running every expert on every token weighted by the router.
  Float32; outputs to 1e-5, gradients to 1e-4 relative (sums of a few hundred products in another order)."""
  cfg = config(*MOE, *path, "routed_scaling_factor=1.5")
  renormalize = "norm_topk_prob=false" not in path
  block, params, x = _block(cfg, renormalize)
  _assert_close_with_grads(cfg, block, params, x, lambda p, x: _reference(cfg, p, x, renormalize)[0])


def test_a_small_capacity_drops_exactly_the_assignments_beyond_it():
  """capacity_factor=0.75: each expert keeps the first C assignments of a sequence in (position, choice) order;
  the output is the reference's with exactly the others dropped, and their number is sown as moe_dropped."""
  cfg = config(*MOE, "capacity_factor=0.75")
  block, params, x = _block(cfg, seed=3)
  capacity = moe.expert_capacity(cfg, cfg.max_target_length)
  assert capacity == 24  # 2 choices * 64 tokens / 4 experts * 0.75
  _, chosen = _reference(cfg, params, x, True)
  keep = np.zeros(chosen.shape, bool)
  for b in range(chosen.shape[0]):
    taken = np.zeros(cfg.num_experts, int)
    for s in range(chosen.shape[1]):
      for j in range(chosen.shape[2]):
        keep[b, s, j] = taken[chosen[b, s, j]] < capacity
        taken[chosen[b, s, j]] += 1
  assert 0 < (~keep).sum() < keep.size // 2, "the test needs some, not most, assignments dropped"
  out, sown = block.apply({"params": params}, x, mutable=["intermediates"])
  want, _ = _reference(cfg, params, x, True, keep=jnp.asarray(keep))
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)
  assert int(sown["intermediates"]["moe_dropped"][0]) == int((~keep).sum())


def test_sigmoid_routing_without_bias_chooses_by_logit_where_sigmoids_saturate():
  """Llama 4's router takes its top-k of the logits: 18 and 20 both have sigmoid 1.0 in float32, and the larger
  logit must win (a choice by score ties them and takes the lower index); the weight is the chosen one's sigmoid."""
  logits = jnp.array([[18.0, 20.0, -3.0, 0.0], [0.5, -1.0, 2.0, 1.0]])
  assert float(jax.nn.sigmoid(jnp.float32(18.0))) == float(jax.nn.sigmoid(jnp.float32(20.0))) == 1.0
  weights, experts, _ = moe.route_sigmoid(logits, 2, None, 0, 0, renormalize=False)
  np.testing.assert_array_equal(experts, [[1, 0], [2, 3]])
  np.testing.assert_allclose(weights, 1 / (1 + np.exp(-np.take_along_axis(np.asarray(logits), experts, 1))), rtol=1e-6)


def test_load_balance_loss_of_a_uniform_router_is_k_and_matches_transformers():
  """A router whose scores are all equal gives exactly k (N * sum_i f_i / N, and the f_i sum to k); a random
  one gives what transformers' Mixtral computes (one sequence: both average over its tokens)."""
  torch = pytest.importorskip("torch")
  from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

  cfg = config(*MOE)
  block, params, x = _block(cfg, batch=1)
  uniform = jax.tree_util.tree_map(lambda a: a, params)
  uniform["gate"]["kernel"] = jnp.zeros_like(params["gate"]["kernel"])
  _, sown = block.apply({"params": uniform}, x, mutable=["intermediates"])
  np.testing.assert_allclose(sown["intermediates"]["moe_lb_loss"][0], cfg.num_experts_per_tok, rtol=1e-6)

  _, sown = block.apply({"params": params}, x, mutable=["intermediates"])
  logits = np.asarray(x[0] @ params["gate"]["kernel"], np.float64)
  want = load_balancing_loss_func((torch.tensor(logits),), cfg.num_experts, cfg.num_experts_per_tok)
  np.testing.assert_allclose(sown["intermediates"]["moe_lb_loss"][0], float(want), rtol=1e-5)


def _model_loss_and_grads(cfg, params, batch):
  model = models.Transformer(cfg)
  fn = jax.jit(
    jax.value_and_grad(lambda p: lm_lib.loss_fn(model, p, batch, jax.random.key(0), deterministic=True), has_aux=True)
  )
  return fn(params)


@pytest.mark.parametrize("family", ONE_STACK_MOE)
def test_the_loss_adds_the_weighted_load_balance_loss_averaged_over_layers(family):
  """loss = cross-entropy + load_balance_loss_weight * mean over layers of each layer's sown loss (per token);
  scanned and unrolled layers give the same loss and gradients."""
  cfg = config(*MOE, f"decoder_block={family}", "load_balance_loss_weight=0.5", "max_target_length=32")
  model = models.Transformer(cfg)
  params = nn.meta.unbox(model.init({"params": jax.random.key(0)}, *models.init_inputs(2, 32)))["params"]
  batch = train_batch(cfg)
  (loss, aux), grads = _model_loss_and_grads(cfg, params, batch)
  _, sown = model.apply({"params": params}, batch["inputs"], batch["inputs_segmentation"], batch["inputs_position"],
                        mutable=["intermediates"])  # fmt: skip
  per_layer = np.asarray(sown["intermediates"]["layers"]["mlp"]["moe_lb_loss"][0])
  assert per_layer.shape == (cfg.num_decoder_layers,)
  tokens = int(aux["tokens"])
  np.testing.assert_allclose(loss / tokens, aux["xent"] / tokens + 0.5 * per_layer.mean(), rtol=1e-6)

  unrolled_cfg = config(*MOE, f"decoder_block={family}", "load_balance_loss_weight=0.5", "max_target_length=32",
                        "scan_layers=false")  # fmt: skip
  unrolled = dict(params)
  stacked = unrolled.pop("layers")
  for i in range(cfg.num_decoder_layers):
    unrolled[f"layers_{i}"] = jax.tree_util.tree_map(lambda a, i=i: a[i], stacked)
  (loss_u, _), grads_u = _model_loss_and_grads(unrolled_cfg, unrolled, batch)
  np.testing.assert_allclose(loss_u, loss, rtol=1e-6)
  for i in range(cfg.num_decoder_layers):
    for (path, g), gu in zip(
      jax.tree_util.tree_leaves_with_path(grads["layers"]), jax.tree_util.tree_leaves(grads_u[f"layers_{i}"]), strict=True
    ):
      np.testing.assert_allclose(g[i], gu, rtol=1e-4, atol=1e-6 * np.abs(gu).max(), err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize(
  "mesh",
  [
    ("ici_expert_parallelism=8", "ici_fsdp_parallelism=1"),
    ("ici_expert_parallelism=4", "ici_fsdp_parallelism=2"),
    ("ici_expert_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"),
    ("ici_expert_parallelism=2", "ici_data_parallelism=2", "ici_fsdp_parallelism=2"),
  ],
  ids=["ep8", "ep4_fsdp2", "ep2_fsdp2_tp2", "ep2_dp2_fsdp2"],
)
@pytest.mark.mesh
def test_expert_parallel_block_equals_one_device(mesh):
  """The dropless block on 8 devices, experts split over the expert axis (rows exchanged by all-to-all), combined
  with fsdp, tensor and data parallelism: the same outputs and gradients as without a mesh (float32; 1e-5 of
  each tensor's largest magnitude: the same products summed in another order)."""
  from MaxText import sharding

  one = config(*MOE, "num_experts=8")
  block, params, x = _block(one, batch=8)
  cfg = config(*MOE, "num_experts=8", *mesh, num_devices=8)
  device_mesh = sharding.create_mesh(cfg, jax.devices()[:8])

  def value_and_grads(b):
    return jax.jit(jax.value_and_grad(lambda p, x: jnp.sum(jnp.sin(b.apply({"params": p}, x))), (0, 1)))(params, x)

  want = value_and_grads(block)
  with jax.set_mesh(device_mesh):
    got = value_and_grads(moe.MoeBlock(cfg, device_mesh, renormalize=True))
  for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * np.abs(np.asarray(w)).max())


@pytest.mark.slow  # Trains seven times; test_expert_parallel_block_equals_one_device is its fast sibling.
def test_expert_parallel_degrees_train_alike_and_checkpoints_restore_across_them(tmp_path):
  """ici_expert_parallelism 1, 2, 4 and 8 train to the same losses (4 steps); a checkpoint written under expert
  parallelism 4 resumes under 1 (fsdp 8) and 2 (with tensor 2) with the uninterrupted run's losses."""
  common = (*MOE, "num_experts=8", "learning_rate=1e-2", "warmup_steps_fraction=0", "per_device_batch_size=1",
            "max_target_length=32", "learning_rate_schedule_steps=4", "async_checkpointing=false",
            f"base_output_directory={tmp_path}", "checkpoint_period=2")  # fmt: skip
  devices = jax.devices()[:8]

  def run(name, steps, *mesh, checkpoints=False):
    cfg = config(*common, f"run_name={name}", f"steps={steps}", f"enable_checkpointing={str(checkpoints).lower()}",
                 *mesh, num_devices=8)  # fmt: skip
    return train.train(cfg, devices)

  straight = [loss for _, loss in run("ep1", 4, "ici_fsdp_parallelism=8").losses]
  for ep in (2, 4, 8):
    got = [loss for _, loss in run(f"ep{ep}", 4, f"ici_expert_parallelism={ep}", "ici_fsdp_parallelism=-1").losses]
    np.testing.assert_allclose(got, straight, rtol=1e-5, err_msg=f"ici_expert_parallelism={ep}")

  run("resumed", 2, "ici_expert_parallelism=4", "ici_fsdp_parallelism=2", checkpoints=True)
  for mesh in (
    ("ici_fsdp_parallelism=8",),
    ("ici_expert_parallelism=2", "ici_tensor_parallelism=2", "ici_fsdp_parallelism=2"),
  ):
    resumed = run("resumed", 4, *mesh, checkpoints=True)
    assert resumed.first_step == 2
    np.testing.assert_allclose([loss for _, loss in resumed.losses], straight[2:], rtol=1e-5, err_msg=str(mesh))
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "4")


@pytest.mark.mesh
def test_sharded_training_equals_one_device():
  """fsdp=2 x tensor=2 over 4 devices trains to the same losses (including the load-balancing loss) as one device,
  with gradient accumulation."""
  common = (*MOE, "steps=3", "learning_rate=1e-2", "warmup_steps_fraction=0", "max_target_length=32")
  one = config(*common, "per_device_batch_size=4", "gradient_accumulation_steps=2")
  four = config(*common, "per_device_batch_size=1", "gradient_accumulation_steps=2", "ici_fsdp_parallelism=2",
                "ici_tensor_parallelism=2", num_devices=4)  # fmt: skip
  assert one.global_batch_size == four.global_batch_size == 8
  want = [loss for _, loss in train.train(one, jax.devices()[:1]).losses]
  got = [loss for _, loss in train.train(four, jax.devices()[:4]).losses]
  np.testing.assert_allclose(got, want, rtol=1e-5)


def test_flops_count_the_active_experts_only():
  """Doubling the experts adds only the router's FLOPs; doubling the experts per token adds their MLPs'."""
  base = metrics.training_flops_per_device(config(*MOE))
  cfg = config(*MOE)
  tokens = cfg.per_device_batch_size * cfg.max_target_length * cfg.num_decoder_layers
  more_experts = metrics.training_flops_per_device(config(*MOE, "num_experts=8"))
  assert more_experts.total - base.total == pytest.approx(3 * tokens * 2 * cfg.emb_dim * 4)
  more_active = metrics.training_flops_per_device(config(*MOE, "num_experts_per_tok=3"))
  assert more_active.total - base.total == pytest.approx(3 * tokens * 2 * cfg.emb_dim * cfg.moe_mlp_dim * 3)


@pytest.mark.parametrize(
  "args, message",
  [
    (("num_experts=1",), "decoder_block=mixtral is a mixture of experts"),
    (("num_experts_per_tok=5",), "num_experts_per_tok=5 must be in [1, num_experts=4]"),
    (("decoder_block=llama2",), "num_experts=4: decoder_block=llama2 has a dense MLP"),
    (("ici_expert_parallelism=8", "ici_fsdp_parallelism=1"), "num_experts=4 does not split over the 8 shards"),
  ],
)
def test_moe_mistakes_are_config_errors(args, message):
  with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
    config(*MOE, *args, num_devices=8 if "ici_expert_parallelism=8" in args else 2)


# Published sizes (billions of parameters, as rounded by their authors): total and active per token.
PUBLISHED = {
  "mixtral-8x7b": ("46.7", "12.9"),  # arXiv:2401.04088
  "mixtral-8x22b": ("141", "39"),  # mistral.ai/news/mixtral-8x22b
  "qwen3-30b-a3b": ("30.5", "3.3"),  # arXiv:2505.09388, table 2
  "qwen3-235b-a22b": ("235", "22"),
  "deepseek3-671b": ("671", "37"),  # arXiv:2412.19437 (without the 14B multi-token-prediction module)
}


@pytest.mark.parametrize("preset", list(PUBLISHED))
def test_preset_parameter_counts_equal_the_published_ones_and_transformers(preset):
  """Our parameters (abstract init) are within one unit of the published figures' last digit (authors round or
  truncate: Qwen3-30B-A3B's 3.35B active are "3.3B"), and equal exactly those of the transformers model built
  (on the meta device) from the config.json our exporter would write. Active: the total less the
  num_experts - num_experts_per_tok experts each token skips, per MoE layer. DeepSeek's routing bias is a
  parameter of ours and a buffer of transformers'."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from MaxText import families
  from MaxText.convert import hf_families

  cfg = config(f"model_name={preset}", "max_target_length=8", "per_device_batch_size=1")
  shapes = jax.eval_shape(lambda: models.Transformer(cfg).init(jax.random.key(0), *models.init_inputs(1, 8)))
  total = metrics.count_params(nn.meta.unbox(shapes)["params"])
  moe_layers = cfg.num_decoder_layers - cfg.first_num_dense_layers
  skipped = (cfg.num_experts - cfg.num_experts_per_tok) * 3 * cfg.emb_dim * cfg.moe_mlp_dim * moe_layers
  for count, published in zip((total, total - skipped), PUBLISHED[preset], strict=True):
    unit = 10.0 ** -len(published.partition(".")[2])
    assert abs(count / 1e9 - float(published)) < unit, (preset, count, published)

  hf_json = hf_families.hf_config(families.hf_mapping(cfg), cfg, "bfloat16")
  hf_cfg = transformers.CONFIG_MAPPING[hf_json["model_type"]](**hf_json)
  with torch.device("meta"):
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg)
  routing_bias = [b.numel() for name, b in hf.named_buffers() if name.endswith("e_score_correction_bias")]  # DeepSeek
  assert sum(p.numel() for p in hf.parameters()) + sum(routing_bias) == total


def test_sigmoid_group_routing_with_shared_experts_equals_transformers_deepseek_v3_moe():
  """DeepSeek-V3's MoE (transformers' DeepseekV3MoE, float32, random weights and balancing bias): sigmoid scores,
  biased choice among the best 2 of 4 expert groups, renormalised and scaled weights, one shared expert. Our
  MoeBlock with the same weights gives the same outputs (1e-5 of the largest) on 128 tokens."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

  keys = ("num_experts=16", "num_experts_per_tok=4", "routed_score_func=sigmoid", "routed_bias=true",
          "n_routing_groups=4", "topk_routing_group=2", "shared_experts=1", "routed_scaling_factor=2.5")  # fmt: skip
  cfg = config(*MOE, *keys)
  hf_cfg = transformers.DeepseekV3Config(
    hidden_size=cfg.emb_dim, moe_intermediate_size=cfg.moe_mlp_dim, n_routed_experts=16, num_experts_per_tok=4,
    n_group=4, topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True,
  )  # fmt: skip
  torch.manual_seed(0)
  hf = DeepseekV3MoE(hf_cfg).eval()
  with torch.no_grad():
    for p in hf.parameters():
      p.normal_(0.0, 0.3)
    hf.gate.e_score_correction_bias.normal_(0.0, 0.3)
  x = np.random.default_rng(0).normal(size=(2, 64, cfg.emb_dim)).astype(np.float32)
  with torch.no_grad():
    want = hf(torch.from_numpy(x)).numpy()

  m = cfg.moe_mlp_dim
  gate_up = hf.experts.gate_up_proj.detach().numpy()  # [experts, 2 * moe_mlp, emb]: gate rows, then up rows
  shared = {n: getattr(hf.shared_experts, n).weight.detach().numpy().T for n in ("gate_proj", "up_proj", "down_proj")}
  params = {
    "gate": {"kernel": hf.gate.weight.detach().numpy().T},
    "gate_bias": hf.gate.e_score_correction_bias.detach().numpy(),
    "wi_0": gate_up[:, :m].transpose(0, 2, 1),
    "wi_1": gate_up[:, m:].transpose(0, 2, 1),
    "wo": hf.experts.down_proj.detach().numpy().transpose(0, 2, 1),
    "shared": {"wi_0": {"kernel": shared["gate_proj"]}, "wi_1": {"kernel": shared["up_proj"]},
               "wo": {"kernel": shared["down_proj"]}},
  }  # fmt: skip
  got = moe.MoeBlock(cfg, renormalize=True).apply({"params": params}, jnp.asarray(x))
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize(
  "keys, message",
  [
    (("routed_bias=true",), "routed_bias=true under softmax routing is a bias on the router's logits"),
    (("routed_bias_update_rate=0.01",), "routed_score_func=sigmoid, or the rate to 0"),
    (("routed_score_func=sigmoid", "n_routing_groups=3", "topk_routing_group=1"), "n_routing_groups=3"),
    (("routed_score_func=tanh",), "routed_score_func='tanh' is not supported"),
  ],
)
def test_routing_mistakes_are_config_errors(keys, message):
  with pytest.raises(ConfigError, match=message):
    config(*MOE, *keys)


@pytest.mark.parametrize("family", ONE_STACK_MOE)
@pytest.mark.parametrize("keys", [("shared_experts=1",), ("routed_score_func=sigmoid",), ("routed_scaling_factor=2.0",)])
def test_export_refuses_what_the_hugging_face_format_cannot_hold(family, keys):
  """A Mixtral or Qwen3-MoE config.json has a softmax router and no shared experts: exporting a model that has
  them is a ConfigError, never a file that routes differently."""
  cfg = config(*MOE, f"decoder_block={family}", *keys)
  with pytest.raises(ConfigError, match="softmax router and no shared experts"):
    families.hf_mapping(cfg).write_config(cfg)


@pytest.mark.mesh
def test_a_decode_step_under_sequence_and_expert_parallelism_equals_one_device():
  """One token per row (a decode step) cannot split over 2 sequence shards: the block keeps that dimension whole
  on each device instead of failing, and gives the unsharded outputs."""
  from MaxText import sharding

  one = config(*MOE, "num_experts=8")
  block, params, _ = _block(one, batch=8)
  x = jax.random.normal(jax.random.key(5), (8, 1, one.emb_dim), jnp.float32)
  cfg = config(*MOE, "num_experts=8", "ici_sequence_parallelism=2", "ici_expert_parallelism=2", "ici_fsdp_parallelism=2",
               num_devices=8)  # fmt: skip
  device_mesh = sharding.create_mesh(cfg, jax.devices()[:8])
  with jax.set_mesh(device_mesh):
    got = jax.jit(moe.MoeBlock(cfg, device_mesh, renormalize=True).apply)({"params": params}, x)
  want = block.apply({"params": params}, x)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name,
                                axis_index_groups):  # fmt: skip
  """jax.lax.ragged_all_to_all as its docstring specifies it, from all-gathers: every source's slice i, sent to
  device i // (slices / devices), written at that source's output_offsets[i] of the result (recv_sizes must match
  the senders' send_sizes; test_exchange_plan_sizes_and_offsets_match_the_padded_exchange checks that they do)."""
  del recv_sizes, axis_index_groups
  operands = jax.lax.all_gather(operand, axis_name)  # [sources, rows, ...]
  starts, sizes, offsets = (jax.lax.all_gather(a, axis_name) for a in (input_offsets, send_sizes, output_offsets))
  sources, slices = starts.shape
  rows = operand.shape[0]
  j = jnp.arange(rows)
  to_me = (jnp.arange(slices) // (slices // sources) == jax.lax.axis_index(axis_name))[None, :, None]
  dest = jnp.where(to_me & (j < sizes[..., None]), offsets[..., None] + j, output.shape[0])  # out of range: dropped
  taken = operands[jnp.arange(sources)[:, None, None], jnp.minimum(starts[..., None] + j, rows - 1)]
  return output.at[dest.reshape(-1)].set(taken.reshape(-1, *operand.shape[1:]), mode="drop")


@pytest.fixture
def ragged_on_cpu(monkeypatch):
  """The exact-size exchange on the CPU: XLA's CPU backend has no ragged-all-to-all, so it is lowered here as
  _emulated_ragged_all_to_all (JAX's own JVP and transpose rules stay: the gradients are JAX's), and the CPU joins
  the platforms that exchange so. The CPU lowering stays registered for the rest of the process (nothing else on the
  CPU can use ragged_all_to_all, which otherwise fails to compile there)."""
  from jax.extend.core.primitives import ragged_all_to_all_p
  from jax.interpreters import mlir

  mlir.register_lowering(ragged_all_to_all_p, mlir.lower_fun(_emulated_ragged_all_to_all, False), platform="cpu")
  monkeypatch.setattr(moe, "RAGGED_EXCHANGE_PLATFORMS", ("tpu", "cpu"))


@pytest.mark.mesh
def test_the_emulated_ragged_all_to_all_gives_the_docstrings_example(ragged_on_cpu):
  """The emulation the exact-exchange tests run on the CPU, on the example of jax.lax.ragged_all_to_all's docstring
  (its results are the docstring's), and its gradient: each operand element gets the cotangent of the result
  element it was written to, the unsent ones zero."""
  mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
  spec = jax.sharding.PartitionSpec("x")

  def exchange(operand, *rest):
    return jax.lax.ragged_all_to_all(operand[0], *(a[0] for a in rest), axis_name="x")[None]

  args = [jnp.array([[1, 2, 2], [3, 4, 0]], jnp.float32), jnp.zeros((2, 4), jnp.float32)]
  args += [jnp.array(a, jnp.int32) for a in ([[0, 1], [0, 1]], [[1, 2], [1, 1]], [[0, 0], [1, 2]], [[1, 1], [2, 1]])]
  run = jax.shard_map(exchange, mesh=mesh, in_specs=(spec,) * 6, out_specs=spec, check_vma=False)
  with jax.set_mesh(mesh):
    args = [jax.device_put(a, jax.sharding.NamedSharding(mesh, spec)) for a in args]
    np.testing.assert_array_equal(jax.jit(run)(*args), [[1, 3, 0, 0], [2, 2, 4, 0]])
    weights = jnp.arange(8.0).reshape(2, 4)
    grad = jax.jit(jax.grad(lambda o, *rest: jnp.sum(run(o, *rest) * weights)))(*args)
  np.testing.assert_array_equal(grad, [[0, 4, 5], [1, 6, 0]])


def _routing(kind: str, ep: int, tokens: int, k: int, num_experts: int, seed: int) -> np.ndarray:
  """Each of ep devices' tokens' k distinct experts [ep, tokens * k]: "random" over all experts, "empty" over a few
  (the others get no rows), "one_shard" all to the experts of shard 0."""
  rng = np.random.default_rng(seed)
  pool = {"random": num_experts, "empty": k + 1, "one_shard": num_experts // ep}[kind]
  chosen = [rng.permutation(pool)[:k] for _ in range(ep * tokens)]
  if kind == "empty":
    chosen = [rng.permutation(num_experts)[: k + 1][c] for c in chosen]  # a random few experts, not the first ones
  return np.asarray(chosen, np.int32).reshape(ep, tokens * k)


def _numpy_exchange(plans, x, ep):
  """Each device's receive buffer by jax.lax.ragged_all_to_all's documented semantics in numpy, from every device's
  ExchangePlan and rows x [ep, rows, ...]: source s's slice i goes to device i // local at the offset the receiver
  gave it (its recv_offsets, which the exchange sends to the source)."""
  local = plans[0].send_sizes.shape[0] // ep
  out = np.full((ep, ep * x.shape[1], *x.shape[2:]), -1, x.dtype)
  for s in range(ep):
    for i, (start, size) in enumerate(zip(plans[s].input_offsets, plans[s].send_sizes, strict=True)):
      d, slice_on_d = i // local, s * local + i % local
      assert plans[d].recv_sizes[slice_on_d] == size, "what d expects from s is what s sends"
      offset = plans[d].recv_offsets[slice_on_d]
      out[d, offset : offset + size] = x[s, start : start + size]
  return out


@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.parametrize("kind", ["random", "empty", "one_shard"])
def test_exchange_plan_sizes_and_offsets_match_the_padded_exchange(ep, kind):
  """moe.exchange_plan, with ragged_all_to_all's semantics modelled in numpy: each device receives exactly the rows
  the padded exchange gives its experts, in the padded exchange's order (by local expert, then source, then the
  source's order), the group sizes count them, and the outputs return to the rows that sent them."""
  num_experts, tokens, k = 8, 6, 2
  local = num_experts // ep
  experts = np.sort(_routing(kind, ep, tokens, k, num_experts, seed=ep), axis=1)  # each device's rows by expert
  sizes_DL = np.stack([np.bincount(e, minlength=num_experts).reshape(ep, local) for e in experts])  # [device, d, l]
  recv_SL = np.transpose(sizes_DL, (1, 0, 2))  # the all-to-all: device d's recv[s] is s's sizes_DL[d]
  plans = [jax.tree.map(np.asarray, moe.exchange_plan(jnp.asarray(sizes_DL[d]), jnp.asarray(recv_SL[d]))) for d in range(ep)]
  row_ids = np.arange(ep * tokens * k).reshape(ep, tokens * k)
  received = _numpy_exchange(plans, row_ids, ep)
  for d in range(ep):
    # The padded exchange's order on shard d (moe._exchange_and_run): local expert, then source, then row.
    want = [row_ids[s][experts[s] == d * local + j] for j in range(local) for s in range(ep)]
    want = np.concatenate(want)
    np.testing.assert_array_equal(received[d, : want.size], want)
    assert (received[d, want.size :] == -1).all(), "nothing past the received rows"
    np.testing.assert_array_equal(plans[d].group_sizes, [np.sum(experts[:, None] == d * local + j) for j in range(local)])
    assert want.size <= moe.receive_rows(tokens * k, k, ep, local)
  # The return: each shard sends back its received slices to where they came from, into exactly tokens * k rows.
  back_plans = [p._replace(input_offsets=p.recv_offsets, send_sizes=p.recv_sizes) for p in plans]
  back_plans = [
    bp._replace(recv_offsets=p.input_offsets, recv_sizes=p.send_sizes) for bp, p in zip(back_plans, plans, strict=True)
  ]
  np.testing.assert_array_equal(_numpy_exchange(back_plans, received, ep)[:, : tokens * k], row_ids)


def _exchanged(exchange, experts, num_experts, ep):
  """Runs `exchange` (moe._exchange_and_run or moe._ragged_exchange_and_run, as a function of (x, experts_A, sizes_N,
  experts_ffn)) on ep devices, each with its rows sorted by expert (experts [ep, rows]) and x = the rows' ids, under
  an experts_ffn that answers, for each row it is given, its id, its local expert and its place among that expert's
  rows: [ep, rows, 3] as the rows get it back."""
  mesh = jax.make_mesh((ep,), ("expert",), devices=jax.devices()[:ep])
  spec = jax.sharding.PartitionSpec("expert")

  def experts_ffn(rows, group_sizes):
    ends = jnp.cumsum(group_sizes)
    expert = jnp.searchsorted(ends, jnp.arange(rows.shape[0]), side="right")
    place = jnp.arange(rows.shape[0]) - (ends - group_sizes)[jnp.minimum(expert, group_sizes.shape[0] - 1)]
    return jnp.stack([rows[:, 0], expert.astype(rows.dtype), place.astype(rows.dtype)], axis=1)

  def device(x, experts_A):
    sizes_N = jnp.bincount(experts_A[0], length=num_experts).astype(jnp.int32)
    return exchange(x[0], experts_A[0], sizes_N, experts_ffn)[None]

  ids = jnp.asarray(np.arange(experts.size, dtype=np.float32).reshape(*experts.shape, 1) * np.ones(3, np.float32))
  run = jax.shard_map(device, mesh=mesh, in_specs=(spec, spec), out_specs=spec, check_vma=False)
  with jax.set_mesh(mesh):
    args = [jax.device_put(a, jax.sharding.NamedSharding(mesh, spec)) for a in (ids, jnp.asarray(experts))]
    return np.asarray(jax.jit(run)(*args))


@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.parametrize("kind", ["random", "empty", "one_shard"])
@pytest.mark.mesh
def test_the_exact_exchange_gives_each_expert_the_rows_the_padded_one_does(ragged_on_cpu, ep, kind):
  """Both exchanges on ep devices (the exact one through the emulated ragged_all_to_all): every row reaches the same
  local expert at the same place among its rows, and its output returns to it (exact: small integers). The exact
  exchange in one round and, under a receive budget of 1, in rounds of one local expert each, with that expert's
  weights."""
  num_experts, tokens, k = 8, 6, 2
  local = num_experts // ep
  experts = np.sort(_routing(kind, ep, tokens, k, num_experts, seed=ep + 10), axis=1)
  axes = ("expert",)
  padded = _exchanged(lambda x, e, n, f: moe._exchange_and_run(x, e, n, ep, axes, f), experts, num_experts, ep)

  def exact(x, _, sizes_N, f):
    # The experts' "weights" are their local indices: a round's first one turns its place in the round into the
    # local expert.
    ffn = lambda rows, group_sizes, w: f(rows, group_sizes) + jnp.array([0.0, 1.0, 0.0]) * w[0]  # noqa: E731
    setup = moe.ExchangeSetup(ep, axes, k)
    return moe._ragged_exchange_and_run(x, sizes_N, setup, ffn, jnp.arange(local, dtype=jnp.float32))

  one_round = _exchanged(exact, experts, num_experts, ep)
  np.testing.assert_array_equal(one_round, padded)
  np.testing.assert_array_equal(one_round[..., 0], np.arange(experts.size).reshape(experts.shape))
  np.testing.assert_array_equal(one_round[..., 1], experts % local)
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(moe, "RECEIVE_BUDGET", 1)
    assert moe.exchange_rounds(tokens * k, k, ep, local) == local
    rounds = _exchanged(exact, experts, num_experts, ep)
  np.testing.assert_array_equal(rounds, one_round)


@pytest.mark.parametrize(
  "mesh, budget",
  [
    (("ici_expert_parallelism=8", "ici_fsdp_parallelism=1"), 8),
    (("ici_expert_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"), 8),
    (("ici_expert_parallelism=2", "ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"), 1),
  ],
  ids=["ep8", "ep2_fsdp2_tp2", "ep2_fsdp2_tp2_in_rounds"],
)
@pytest.mark.mesh
def test_the_exact_exchange_block_equals_one_device(ragged_on_cpu, monkeypatch, mesh, budget):
  """The dropless block with the exact-size exchange (ragged_all_to_all, emulated on the CPU; its gradient by JAX's
  transpose rule) on 8 devices, in one round and (RECEIVE_BUDGET 1) in rounds of one local expert, rematerialised
  in the backward pass: the outputs and gradients of one device (float32; 1e-5 of each tensor's largest magnitude,
  as test_expert_parallel_block_equals_one_device)."""
  from MaxText import sharding

  monkeypatch.setattr(moe, "RECEIVE_BUDGET", budget)

  one = config(*MOE, "num_experts=8")
  block, params, x = _block(one, batch=8)
  cfg = config(*MOE, "num_experts=8", *mesh, num_devices=8)
  device_mesh = sharding.create_mesh(cfg, jax.devices()[:8])

  def value_and_grads(b):
    return jax.jit(jax.value_and_grad(lambda p, x: jnp.sum(jnp.sin(b.apply({"params": p}, x))), (0, 1)))(params, x)

  want = value_and_grads(block)
  with jax.set_mesh(device_mesh):
    exact = moe.MoeBlock(cfg, device_mesh, renormalize=True)
    assert "ragged_all_to_all" in str(jax.make_jaxpr(lambda p, x: exact.apply({"params": p}, x))(params, x))
    got = value_and_grads(exact)
  for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * np.abs(np.asarray(w)).max())


@pytest.mark.mesh
def test_expert_biases_under_the_exact_exchange_with_megablox_leave_the_rows_past_the_groups_out(ragged_on_cpu, monkeypatch):
  """gpt-oss's expert biases with the exact-size exchange on 2 expert shards and the TPU's grouped matmul (Pallas
  megablox in interpret mode, which leaves the rows past the groups NaN, forward and backward, since the exchange
  reads none of them): outputs and gradients, the biases' included and all finite, those of one device (tiled)."""
  from MaxText import sharding
  from MaxText.layers.grouped_matmul import megablox_grouped_matmul

  unread = []

  def megablox_interpreted(x, w, group_sizes, platform, megablox, quantized, rest_unread):
    del platform, megablox, quantized
    unread.append(rest_unread)
    return megablox_grouped_matmul(x, w, group_sizes, interpret=True, zero_rest=not rest_unread)

  keys = (*MOE, "decoder_block=gpt_oss", "mlp_activations=['sigmoid','linear']", "mlp_activations_limit=1.0",
          "max_target_length=16")  # fmt: skip
  one = config(*keys)
  x = jax.random.normal(jax.random.key(1), (2, one.max_target_length, one.emb_dim), jnp.float32)
  params = nn.meta.unbox(moe.MoeBlock(one, renormalize=True, use_bias=True).init(jax.random.key(0), x))["params"]
  params = jax.tree.map(lambda p: jax.random.normal(jax.random.key(p.size), p.shape), params)  # nonzero biases too

  def value_and_grads(b):
    return jax.jit(jax.value_and_grad(lambda p, x: jnp.sum(jnp.sin(b.apply({"params": p}, x))), (0, 1)))(params, x)

  want = value_and_grads(moe.MoeBlock(one, renormalize=True, use_bias=True))
  cfg = config(*keys, "ici_expert_parallelism=2", "ici_fsdp_parallelism=1", num_devices=2)
  device_mesh = sharding.create_mesh(cfg, jax.devices()[:2])
  monkeypatch.setattr(moe, "grouped_matmul", megablox_interpreted)
  with jax.set_mesh(device_mesh):
    got = value_and_grads(moe.MoeBlock(cfg, device_mesh, renormalize=True, use_bias=True))
  assert unread and all(unread), "megablox ran with the rows past the groups left undefined"
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves(want), strict=True):
    assert np.isfinite(g).all(), jax.tree_util.keystr(path)
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5 * np.abs(np.asarray(w)).max(), err_msg=jax.tree_util.keystr(path))
