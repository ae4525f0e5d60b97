"""The deepseek family beyond its Hugging Face parity (hf_checkpoint_test): multi-head latent attention's
compressed KV cache against the uncached forward, its dense and MoE layer stacks scanned and unrolled, sharded
training, FLOPs and config errors. The family's preset sizes are checked in moe_test with the other MoE presets."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from MaxText import common_types as ct
from MaxText import metrics, optimizers, sharding, train
from MaxText import state as state_lib
from MaxText import step as step_lib
from MaxText.common_types import ConfigError
from MaxText.inference import engine as engine_lib
from MaxText.layers import models
from MaxText.objectives import lm as lm_lib
from MaxText.tests.helpers import assert_sharded_decode_equals_one_device, config, train_batch

TINY_DEEPSEEK = ("model_name=deepseek3-tiny", "max_target_length=32", "max_prefill_predict_length=16")


def _init(cfg, seed=0):
  model = models.Transformer(cfg)
  params = nn.meta.unbox(model.init({"params": jax.random.key(seed)}, *models.init_inputs(1, cfg.max_target_length)))
  params = params["params"]
  # Nonzero routing biases, so the choice differs from the unbiased one in the comparisons below.
  bias = params["moe_layers"]["mlp"]["gate_bias"]
  params["moe_layers"]["mlp"]["gate_bias"] = jax.random.normal(jax.random.key(seed + 1), bias.shape) * 0.3
  return params


def _log_softmax(logits):
  logits = np.asarray(logits, np.float64)
  shifted = logits - logits.max(-1, keepdims=True)
  return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def test_decoding_from_the_latent_cache_equals_the_uncached_forward():
  """Two prompts (24 and 19 tokens) prefilled in chunks of 8, the later chunks attending to the cache, then 8 greedy
  steps: each prompt token's logprob (echo) and each generated token's, with the 5 most likely, equal the full
  forward's log-softmax (float32, 1e-5 of the largest logit), and the paged cache holds the compressed latent and the
  shared RoPE key per token and layer, not every head's keys and values."""
  chunked = ("max_prefill_predict_length=24", "use_chunked_prefill=true", "prefill_chunk_size=8")
  cfg = config(*TINY_DEEPSEEK, *chunked, "per_device_batch_size=2")
  params = _init(cfg)
  engine = engine_lib.Engine(cfg, sharding.create_mesh(cfg, jax.devices()[:1]), params)
  keys, values = engine.pool
  assert keys.shape[0] == values.shape[0] == cfg.num_decoder_layers
  assert keys.shape[2:] == (cfg.pagedattn_tokens_per_page, 1, cfg.kv_lora_rank)
  assert values.shape[2:] == (cfg.pagedattn_tokens_per_page, 1, cfg.qk_rope_head_dim)

  rng = np.random.default_rng(0)
  prompts = [tuple(int(t) for t in rng.integers(1, cfg.vocab_size, n)) for n in (24, 19)]
  results = engine.generate([engine_lib.Request(p, 8, logprobs=5, echo=True) for p in prompts])
  for row, (prompt, result) in enumerate(zip(prompts, results, strict=True)):
    seq = np.asarray([[*prompt, *result.tokens]], np.int32)
    positions = np.arange(seq.shape[1], dtype=np.int32)[None]
    logits = np.asarray(models.Transformer(cfg).apply({"params": params}, seq, np.ones_like(seq), positions))[0, :-1]
    want = _log_softmax(logits)
    assert len(result.tokens) == 8 and result.tokens == list(np.argmax(want[len(prompt) - 1 :], -1)), row
    got = [*result.prompt_logprobs[1:], *result.logprobs]
    assert result.prompt_logprobs[0] is None and len(got) == len(want)
    for i, (lp, target) in enumerate(zip(got, seq[0, 1:], strict=True)):
      top = np.argsort(-want[i], kind="stable")[:5]
      assert [t for t, _ in lp.top] == list(top), (row, i)
      np.testing.assert_allclose([lp.logprob, *(x for _, x in lp.top)], [want[i, target], *want[i, top]],
                                 rtol=0, atol=1e-5 * np.abs(logits).max(), err_msg=f"row {row}, position {i}")  # fmt: skip


def _loss_and_grads(cfg, params, batch):
  model = models.Transformer(cfg)
  loss = lambda p: lm_lib.loss_fn(model, p, batch, jax.random.key(0), deterministic=True)  # noqa: E731
  return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)


@pytest.mark.slow  # Its fast sibling: model_test's scanned-equals-unrolled (one stack).
def test_dense_and_moe_stacks_scanned_equal_unrolled():
  """The scanned stacks `dense_layers` (1 layer) and `moe_layers` (2) give the loss (with the load-balancing
  loss) and gradients of the unrolled dense_layers_0, moe_layers_0 and moe_layers_1."""
  common = (*TINY_DEEPSEEK, "load_balance_loss_weight=0.1")
  cfg = config(*common)
  params = _init(cfg)
  batch = train_batch(cfg)
  (loss, _), grads = _loss_and_grads(cfg, params, batch)
  unrolled = {k: v for k, v in params.items() if not k.endswith("_layers")}
  for stack in ("dense_layers", "moe_layers"):
    count = jax.tree_util.tree_leaves(params[stack])[0].shape[0]
    for j in range(count):
      unrolled[f"{stack}_{j}"] = jax.tree_util.tree_map(lambda a, j=j: a[j], params[stack])
  (loss_u, _), grads_u = _loss_and_grads(config(*common, "scan_layers=false"), unrolled, batch)
  np.testing.assert_allclose(loss_u, loss, rtol=1e-6)
  for stack in ("dense_layers", "moe_layers"):
    for path, g in jax.tree_util.tree_leaves_with_path(grads[stack]):
      for j in range(g.shape[0]):
        gu = grads_u[f"{stack}_{j}"]
        for key in path:
          gu = gu[key.key]
        np.testing.assert_allclose(g[j], gu, rtol=1e-4, atol=1e-6 * np.abs(gu).max(), err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow  # Its fast sibling: moe_test's test_sharded_training_equals_one_device (Mixtral's experts).
def test_sharded_training_equals_one_device():
  """expert 2 x fsdp 2 x tensor 2 on 8 devices (MLA's heads over tensor, its compressed ranks over fsdp) trains
  3 steps to the losses of one device."""
  common = (*TINY_DEEPSEEK, "steps=3", "learning_rate=1e-2", "warmup_steps_fraction=0", "load_balance_loss_weight=0.01")
  one = config(*common, "per_device_batch_size=8")
  eight = config(*common, "per_device_batch_size=1", "ici_expert_parallelism=2", "ici_fsdp_parallelism=2",
                 "ici_tensor_parallelism=2", num_devices=8)  # fmt: skip
  want = [loss for _, loss in train.train(one, jax.devices()[:1]).losses]
  got = [loss for _, loss in train.train(eight, jax.devices()[:8]).losses]
  np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("q_lora", ["32", "0"])
def test_weight_flops_are_six_per_active_matmul_parameter(q_lora):
  """The model FLOPs of the weights are 6 per token per parameter a token's matmuls use: all but the embedding
  table, the norms, the routing bias and the experts it is not routed to (counted from the initialised model)."""
  cfg = config(*TINY_DEEPSEEK, "override_model_config=true", f"q_lora_rank={q_lora}", "per_device_batch_size=2")
  params = _init(cfg)
  moe_layers = cfg.num_decoder_layers - cfg.first_num_dense_layers
  flat = {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(params)}
  unused = [k for k in flat if "token_embedder" in k or "scale" in k or "gate_bias" in k]
  skipped = (cfg.num_experts - cfg.num_experts_per_tok) * 3 * cfg.emb_dim * cfg.moe_mlp_dim * moe_layers
  active = sum(x.size for k, x in flat.items() if k not in unused) - skipped
  tokens = cfg.per_device_batch_size * cfg.max_target_length
  assert metrics.training_flops_per_device(cfg).weights == 6 * tokens * active


@pytest.mark.parametrize(
  "args, message",
  [
    (("attention_type=global",), "decoder_block=deepseek needs attention_type='mla'"),
    (("model_name=tiny", "attention_type=mla"), "decoder_block=llama2 needs attention_type='global'"),
    (("model_name=tiny", "first_num_dense_layers=1"), "decoder_block=llama2 has no dense layers"),
    (("first_num_dense_layers=4",), "first_num_dense_layers=4 must be in [0, base_num_decoder_layers=3)"),
    (("first_num_dense_layers=3",), "needs at least one MoE layer"),
    (("sliding_window_size=8",), "sliding_window_size=8 has no effect with attention_type=mla"),
    (("fused_qkv=true",), "fused_qkv=True has no effect with attention_type=mla"),
    (("attn_logits_soft_cap=30",), "attn_logits_soft_cap=30.0 has no effect"),
    (("rope_attention_scaling=true",), "rope_attention_scaling=True has no effect"),
    (("ici_fsdp_parallelism=32", "kv_lora_rank=16"), "kv_lora_rank=16 does not split over the 32 shards"),
    (("qk_rope_head_dim=7",), "qk_rope_head_dim=7 is odd"),
    (("kv_lora_rank=0",), "kv_lora_rank=0 must be positive"),
    (("routed_bias=false", "routed_bias_update_rate=0.001"), "routed_bias_update_rate=0.001"),
  ],
)
def test_deepseek_mistakes_are_config_errors(args, message):
  devices = 32 if "ici_fsdp_parallelism=32" in args else 1
  with pytest.raises(ConfigError, match=re.escape(message)):
    config(*TINY_DEEPSEEK, "override_model_config=true", *args, num_devices=devices)


def test_a_quantized_checkpoint_is_refused_with_what_to_do():
  from MaxText import families

  with pytest.raises(ConfigError, match="quantization_config \\(fp8\\) is not supported.*dequantize them to bfloat16"):
    families.model_keys_from_hf({"model_type": "deepseek_v3", "quantization_config": {"quant_method": "fp8"}})


def test_the_softmax_scale_follows_yarn_and_max_position_embeddings():
  """DeepSeek's softmax scale: 1/sqrt(qk head dim) times (0.1 * mscale * ln(rope_factor) + 1)^2, only when the
  context was extended beyond original_max_position_embeddings."""
  from MaxText.layers.attention_mla import softmax_scale

  cfg = config(*TINY_DEEPSEEK, "override_model_config=true", "mscale=0.7")
  want = 24**-0.5 * (0.1 * 0.7 * np.log(40.0) + 1.0) ** 2
  assert softmax_scale(cfg) == pytest.approx(want, rel=1e-12)
  short = config(*TINY_DEEPSEEK, "override_model_config=true", "max_position_embeddings=4096")
  assert softmax_scale(short) == pytest.approx(24**-0.5, rel=1e-12)


@pytest.mark.slow
def test_train_decode_and_unrolled_params_only_checkpoint_from_the_command_line(tmp_path, capsys):
  """train.py (expert 2 x fsdp 4 on 8 devices) -> decode.py; generate_param_only_checkpoint.py force_unroll=true
  (dense_layers_0, moe_layers_0, moe_layers_1) -> decode.py with scan_layers=false decodes the same text."""
  from MaxText import decode, generate_param_only_checkpoint, train_tokenizer
  from MaxText.tests.helpers import BASE_YML, overrides

  texts = [f"The {w} of the {v} is {n} and the {v} of the {w} is {n + 1}." for n in range(60) for w, v in [("sun", "sea")]]
  train_tokenizer.train(texts * 5, vocab_size=300, output=str(tmp_path / "tok.model"))
  common = (*TINY_DEEPSEEK, "override_model_config=true", "vocab_size=512", f"base_output_directory={tmp_path}",
            f"tokenizer_path={tmp_path}/tok.model", "per_device_batch_size=1")  # fmt: skip
  cfg = config(*common, "run_name=run", "steps=2", "enable_checkpointing=true", "async_checkpointing=false",
               "ici_expert_parallelism=2", "ici_fsdp_parallelism=4", num_devices=8)  # fmt: skip
  train.train(cfg)

  def run(main, *args):
    code = main(["prog", BASE_YML, *overrides(*common, *args)])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out

  out = run(decode.main, "run_name=run", "prompt=The sun")
  line = next(x for x in out.splitlines() if x.startswith("Input `The sun` -> `"))
  source = f"load_full_state_path={tmp_path}/run/checkpoints/2/items"
  run(generate_param_only_checkpoint.main, "run_name=params", source, "force_unroll=true")
  params_only = f"load_parameters_path={tmp_path}/params/checkpoints/0/items"
  out = run(decode.main, "run_name=other", params_only, "scan_layers=false", "prompt=The sun")
  assert line in out.splitlines()


def test_the_block_counts_the_assignments_the_router_makes():
  """The counts the bias update balances: per expert, the tokens routed to it, equal to a NumPy top-k of the
  sigmoid scores plus the bias (no expert groups here)."""
  from MaxText.layers import moe

  cfg = config(*TINY_DEEPSEEK, "override_model_config=true", "routed_bias_update_rate=0.01", "n_routing_groups=-1",
               "topk_routing_group=-1")  # fmt: skip
  block = moe.MoeBlock(cfg, renormalize=True)
  x = jax.random.normal(jax.random.key(3), (2, 32, cfg.emb_dim))
  params = nn.meta.unbox(block.init(jax.random.key(4), x))["params"]
  params["gate_bias"] = jax.random.normal(jax.random.key(5), (cfg.num_experts,)) * 0.5
  _, sown = block.apply({"params": params}, x, mutable=["intermediates"])
  logits = np.asarray(x, np.float64).reshape(-1, cfg.emb_dim) @ np.asarray(params["gate"]["kernel"], np.float64)
  choice = 1 / (1 + np.exp(-logits)) + np.asarray(params["gate_bias"], np.float64)
  chosen = np.argsort(-choice, axis=-1)[:, : cfg.num_experts_per_tok]
  want = np.bincount(chosen.ravel(), minlength=cfg.num_experts)
  np.testing.assert_array_equal(sown["intermediates"]["moe_expert_counts"][0], want)


@pytest.mark.parametrize("scan", ["true", pytest.param("false", marks=pytest.mark.slow)])
def test_a_training_step_moves_each_routing_bias_towards_balance(scan):
  """After one step (learning rate 0, so only the bias moves), each MoE layer's bias is its old value plus
  rate * sign(mean count - count) of that layer's assignment counts over the step's batch (float64 NumPy from
  the counts of a forward pass on the same batch); with 2 micro-batches of gradient accumulation the same."""
  rate = 0.01
  common = (*TINY_DEEPSEEK, "override_model_config=true", f"routed_bias_update_rate={rate}", f"scan_layers={scan}",
            "learning_rate=0", "per_device_batch_size=4")  # fmt: skip
  cfg = config(*common)
  model = models.Transformer(cfg)
  params = nn.meta.unbox(model.init({"params": jax.random.key(0)}, *models.init_inputs(1, cfg.max_target_length)))
  params = params["params"]
  batch = train_batch(cfg, rows=4)
  _, sown = model.apply({"params": params}, batch["inputs"], batch["inputs_segmentation"], batch["inputs_position"],
                        mutable=["intermediates"])  # fmt: skip
  stacks = ["moe_layers"] if scan == "true" else ["moe_layers_0", "moe_layers_1"]
  for k in (1, 2):
    step_cfg = config(*common, f"gradient_accumulation_steps={k}", f"per_device_batch_size={4 // k}")
    schedule = optimizers.learning_rate_schedule(step_cfg)
    tx = optimizers.create_optimizer(step_cfg, schedule)
    state = state_lib.TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))
    new_state, _ = jax.jit(lambda s, b: step_lib.train_step(model, step_cfg, tx, schedule, s, b))(state, batch)
    for stack in stacks:
      counts = np.asarray(sown["intermediates"][stack]["mlp"]["moe_expert_counts"][0], np.float64)
      want = np.asarray(params[stack]["mlp"]["gate_bias"], np.float64)
      want = want + rate * np.sign(counts.mean(axis=-1, keepdims=True) - counts)
      got = new_state.params[stack]["mlp"]["gate_bias"]
      np.testing.assert_allclose(got, want, rtol=0, atol=1e-7, err_msg=f"{stack}, {k} micro-batches")
      assert np.any(counts != counts.mean(axis=-1, keepdims=True))  # the routing is not balanced already


@pytest.mark.slow  # Its fast siblings: inference_test's sharded decode and the latent cache test below.
def test_sharded_decode_equals_single_device():
  """fsdp 2 x expert 2 x tensor 2 on 8 devices: the paged latent cache's one latent "head" is kept whole (MLA's heads
  go over tensor in the projections; pages are not split); the same tokens and logprobs as one device."""
  one = config(*TINY_DEEPSEEK, "per_device_batch_size=8")
  eight = config(*TINY_DEEPSEEK, "per_device_batch_size=1", "ici_fsdp_parallelism=2", "ici_expert_parallelism=2",
                 "ici_tensor_parallelism=2", num_devices=8)  # fmt: skip
  rng = np.random.default_rng(2)
  prompts = [rng.integers(1, one.vocab_size, n).astype(np.int32) for n in (4, 12, 7, 1, 16, 9, 14, 3)]
  engine8 = assert_sharded_decode_equals_one_device(one, eight, _init(one), prompts)
  spec = sharding.logical_to_mesh_spec((ct.LAYERS, None, None, *ct.LATENT_CACHE_AXES[2:]), eight)
  for pool in engine8.pool:
    assert pool.sharding.spec == spec and pool.addressable_shards[0].data.shape == pool.shape


def test_a_scan_layers_mismatch_names_the_layout_for_the_dense_and_moe_stacks(tmp_path):
  """A params-only checkpoint of unrolled layers (dense_layers_0, moe_layers_0, ...) checked against the scanned
  stacks (dense_layers, moe_layers), and the reverse: the one-line scan_layers message, not a missing tensor."""
  from MaxText import checkpointing

  def abstract(scan):
    cfg = config(*TINY_DEEPSEEK, f"scan_layers={scan}")
    shapes = jax.eval_shape(lambda: models.Transformer(cfg).init(jax.random.key(0), *models.init_inputs(1, 32)))
    return nn.meta.unbox(shapes)["params"]

  for saved, wanted, says in (("false", "true", "scan_layers=true needs them stacked"),
                              ("true", "false", "scan_layers=false needs them one by one")):  # fmt: skip
    zeros = jax.tree_util.tree_map(lambda a: np.zeros(a.shape, a.dtype), abstract(saved))
    path = checkpointing.save_params(str(tmp_path / f"scan_{saved}"), zeros)
    with pytest.raises(ConfigError, match=says):
      checkpointing.check_compatible(path, {"params": abstract(wanted)})
