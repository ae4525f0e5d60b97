"""The int8 KV cache (quantize_kvcache, kv_quant_axis): layers/kv_cache.py's quantize and dequantize against NumPy, the
pool the engine writes, decoding and perplexity of a model trained briefly on the demo corpus against the float
cache's, sharded against one device, and decode.py end to end."""

import os
import re
import sys

import jax
import numpy as np
import pytest
from flax import linen as nn

from MaxText import checkpointing, sharding, train, train_tokenizer
from MaxText import common_types as ct
from MaxText.inference import engine as engine_lib
from MaxText.inference import prompts as prompts_lib
from MaxText.input_pipeline import tokenizer as tokenizer_lib
from MaxText.layers import kv_cache, models
from MaxText.tests.helpers import BASE_YML, assert_sharded_decode_equals_one_device, config, overrides, run

AXES = ("dkv", "heads_and_dkv")
DECODE = ("max_target_length=48", "max_prefill_predict_length=32", "per_device_batch_size=1")


def reference_quantize(x, axis: str):
  """The scheme of the issue written out in NumPy: symmetric absmax over head_dim (dkv) or over the heads and head_dim
  (heads_and_dkv), scale = absmax / 127 (times float32(1 / 127), as XLA divides by a constant), values rounded half
  to even and clipped to [-127, 127]; a zero group gets scale 0 and values 0. x float32 [..., heads, head_dim] ->
  (int8 values, float32 scales with the reduced axes 1)."""
  x = np.asarray(x, np.float32)
  reduced = (-1,) if axis == "dkv" else (-2, -1)
  scale = np.abs(x).max(axis=reduced, keepdims=True) * np.float32(1 / 127)  # float32 division by 127 as XLA does it
  return np.clip(np.round(x / np.where(scale == 0, np.float32(1), scale)), -127, 127).astype(np.int8), scale


def _params(cfg, seed=0):
  model = models.Transformer(cfg)
  return nn.meta.unbox(model.init({"params": jax.random.key(seed)}, *models.init_inputs(1, cfg.max_target_length)))["params"]


def _engine(cfg, params, devices=1):
  return engine_lib.Engine(cfg, sharding.create_mesh(cfg, jax.devices()[:devices]), params)


def _nbytes(tree) -> int:
  return sum(leaf.nbytes for leaf in jax.tree_util.tree_leaves(tree))


# ------------------------------------------------------------------------------------------ the scheme
@pytest.mark.parametrize("axis", AXES)
def test_quantize_and_dequantize_equal_the_numpy_reference(axis):
  """Random keys with a zero token (padding) and a hand-made head whose scale is 1, so that x / scale lands on
  halves: the values and scales equal the NumPy reference bit for bit, the halves round to even, and the
  dequantized values are values * scales, within half a scale of x."""
  rng = np.random.default_rng(0)
  x = (rng.standard_normal((2, 5, 3, 8)) * rng.uniform(0.01, 10, (2, 5, 3, 1))).astype(np.float32)
  x[1, 2] = 0
  halves = np.asarray([127, 2.5, 3.5, -2.5, -0.5, 0.5, 1.5, -126.5], np.float32)
  x[0, 0] = 0.25 * halves  # the other heads of the token, smaller, keep heads_and_dkv's scale at 1 too
  x[0, 0, 0] = halves
  q = kv_cache.quantize(jax.numpy.asarray(x), axis)
  want_values, want_scales = reference_quantize(x, axis)
  assert q.values.dtype == np.int8 and q.scales.dtype == np.float32
  assert q.scales.shape == ((2, 5, 3, 1) if axis == "dkv" else (2, 5, 1, 1))
  np.testing.assert_array_equal(np.asarray(q.scales), want_scales)
  np.testing.assert_array_equal(np.asarray(q.values), want_values)
  np.testing.assert_array_equal(np.asarray(q.values)[0, 0, 0], [127, 2, 4, -2, 0, 0, 2, -126])  # half to even
  assert not np.asarray(q.values)[1, 2].any() and not np.asarray(q.scales)[1, 2].any()
  back = np.asarray(kv_cache.dequantize(q))
  np.testing.assert_array_equal(back, want_values.astype(np.float32) * want_scales)
  assert np.all(np.abs(back - x) <= want_scales / 2 * (1 + 1e-6))


def test_rows_dequantize_what_the_page_table_gathers():
  """A paged quantized cache read through its table: each row's slots are its pages' dequantized tokens in order,
  gathered here in NumPy from the stored values and scales."""
  rng = np.random.default_rng(1)
  pool = rng.standard_normal((6, 4, 2, 8)).astype(np.float32)  # [pages, page_size, kv_heads, head_dim]
  table = np.asarray([[3, 0], [5, 1]], np.int32)
  keys, values = kv_cache.quantize(pool, "dkv"), kv_cache.quantize(pool * 2, "heads_and_dkv")
  got_keys, got_values = kv_cache.rows(kv_cache.Paged(keys, values, table))
  for got, q in ((got_keys, keys), (got_values, values)):
    deq = np.asarray(q.values, np.float32) * np.asarray(q.scales)
    np.testing.assert_array_equal(np.asarray(got), deq[table].reshape(2, 8, 2, 8))


# ------------------------------------------------------------------------------------------ the pool
@pytest.mark.parametrize(
  ("model", "axis"),
  [
    ("tiny", "dkv"),
    ("tiny", "heads_and_dkv"),
    pytest.param("deepseek3-tiny", "dkv", marks=pytest.mark.slow),  # 13 s of compiling on a cold cache
  ],
  ids=["gqa-dkv", "gqa-heads", "mla"],
)
def test_the_pool_holds_int8_values_and_the_scales_of_the_float_keys(model, axis):
  """Two prompts prefilled (max_tokens=1: only the prefill writes, and it attends to exact keys either way): the
  quantized engine's pool is the float engine's pool quantized by the NumPy reference, every page alike (unwritten
  slots: zeros), and it takes int8 values plus one float32 scale per token and group, no float values. MLA's latent
  and RoPE key are one "head" each: a scale per token."""
  cfg = config(f"model_name={model}", *DECODE, "per_device_batch_size=2")
  quant = config(f"model_name={model}", *DECODE, "per_device_batch_size=2", "quantize_kvcache=true", f"kv_quant_axis={axis}")
  params = _params(cfg)
  prompts = [tuple(int(t) for t in np.random.default_rng(n).integers(1, cfg.vocab_size, n)) for n in (21, 7)]
  engines = [_engine(c, params) for c in (cfg, quant)]
  for engine in engines:
    engine.generate([engine_lib.Request(p, 1) for p in prompts])
  floats, quantized = engines[0].pool, engines[1].pool
  for name, full, q in zip(("keys", "values"), floats, quantized, strict=True):
    assert isinstance(q, kv_cache.Quantized) and q.values.dtype == np.int8 and q.scales.dtype == np.float32, name
    want_values, want_scales = reference_quantize(full, axis)
    np.testing.assert_array_equal(np.asarray(q.scales), want_scales, err_msg=name)
    np.testing.assert_array_equal(np.asarray(q.values), want_values, err_msg=name)
    assert (np.asarray(q.scales) > 0).sum() == cfg.num_decoder_layers * 28 * want_scales.shape[-2], name
    # int8 values (1 byte) and a float32 scale per group, where the float cache held 4 bytes per value.
    groups = want_scales.size
    assert _nbytes(q) == full.size + 4 * groups and full.nbytes == 4 * full.size, name


# ------------------------------------------------------------------------------------------ a trained model
@pytest.fixture(scope="module")
def demo(tmp_path_factory):
  """The tiny model (GQA: 4 query heads over 2 KV heads) trained 200 steps on 47 documents of the demo corpus
  (build_demo_dataset.py; a 512-token SentencePiece tokenizer trained on them), its training loss ~3.8 from ln 512
  = 6.2, and 32 sequences of 48 tokens of the corpus' validation documents. ~15 s on 2 cores."""
  from MaxText import build_demo_dataset

  root = tmp_path_factory.mktemp("kv_quant")
  build_demo_dataset.build(str(root / "demo"), max_documents=60, include_debian=False, validation_fraction=0.2,
                           with_tfds=False)  # fmt: skip
  texts = list(train_tokenizer.documents(f"{root}/demo/array_record/train/*", 10**7))
  train_tokenizer.train(texts, vocab_size=512, output=str(root / "tok.model"))
  common = ("vocab_size=512", "override_model_config=true", f"base_output_directory={root}", "run_name=run",
            f"tokenizer_path={root}/tok.model")  # fmt: skip
  train.train(config(*common, "enable_checkpointing=true", "async_checkpointing=false", "dataset_type=grain",
                     f"grain_train_files={root}/demo/array_record/train/*", "per_device_batch_size=2",
                     "learning_rate=1e-2", "log_period=100", "steps=200", num_devices=8))  # fmt: skip
  cfg = config(*common, "max_target_length=64", "max_prefill_predict_length=48", "per_device_batch_size=8")
  mesh = sharding.create_mesh(cfg, jax.devices()[:1])
  params, _ = checkpointing.load_params(cfg, mesh, engine_lib.params_dtype(cfg, mesh))
  tokenizer = tokenizer_lib.load(f"{root}/tok.model")
  held_out = [
    t for text in train_tokenizer.documents(f"{root}/demo/array_record/validation/*", 10**7) for t in tokenizer.encode(text)
  ]
  sequences = [tuple(held_out[i * 48 : (i + 1) * 48]) for i in range(32)]
  assert len(sequences[-1]) == 48
  return {"common": common, "cfg": cfg, "mesh": mesh, "params": params, "sequences": sequences, "tokenizer": tokenizer}


def _greedy_and_logprobs(demo, *keys):
  """(greedy tokens: 32 after each sequence's first 16, the teacher-forced logprobs [32, 47] of each sequence's
  tokens after its first). The logprobs come from echo with prefill_chunk_size=1: each token is its own prefill
  chunk, so it reads every earlier token through the cache, as a decode step does."""
  cfg = config(*demo["common"], "max_target_length=64", "max_prefill_predict_length=48", "per_device_batch_size=8", *keys)
  engine = engine_lib.Engine(cfg, demo["mesh"], demo["params"])
  greedy = [r.tokens for r in engine.generate([engine_lib.Request(s[:16], 32) for s in demo["sequences"]])]
  chunked = config(*demo["common"], "max_target_length=64", "max_prefill_predict_length=48", "per_device_batch_size=8",
                   "use_chunked_prefill=true", "prefill_chunk_size=1", *keys)  # fmt: skip
  engine = engine_lib.Engine(chunked, demo["mesh"], demo["params"])
  echoed = engine.generate([engine_lib.Request(s, 1, logprobs=0, echo=True) for s in demo["sequences"]])
  return greedy, np.asarray([[x.logprob for x in r.prompt_logprobs[1:]] for r in echoed])


@pytest.fixture(scope="module")
def float_cache(demo):
  return _greedy_and_logprobs(demo)


@pytest.mark.parametrize("axis", AXES)
@pytest.mark.mesh
def test_the_int8_cache_keeps_the_greedy_tokens_and_the_perplexity(demo, float_cache, axis):
  """The demo model's 32 greedy tokens after 16 of each of 32 held-out sequences: the same as the float cache's on
  at least 28 of the 32 prompts (87.5%; measured 32 of 32 for either axis). Its perplexity over the sequences, every
  token teacher-forced through the cache: within 1% of the float cache's (measured 42.19 both, 0.003% apart; an int8
  step is 1/254 of a group's range, noise well below a trained model's margins)."""
  want_greedy, want_lp = float_cache
  greedy, lp = _greedy_and_logprobs(demo, "quantize_kvcache=true", f"kv_quant_axis={axis}")
  same = sum(g == w for g, w in zip(greedy, want_greedy, strict=True))
  assert same >= 28, f"{same} of 32 prompts keep the float cache's greedy tokens"
  ppl, want_ppl = np.exp(-lp.mean()), np.exp(-want_lp.mean())
  assert want_ppl < 100, f"the demo model must predict better than chance (512 tokens): perplexity {want_ppl:.1f}"
  assert abs(ppl / want_ppl - 1) < 0.01, (ppl, want_ppl)
  assert np.abs(lp - want_lp).max() > 0, "the quantized cache changed nothing: is it read at all?"


@pytest.mark.slow
def test_decode_cli_with_the_int8_cache_prints_the_engines_text(demo):
  """python3 MaxText/decode.py ... quantize_kvcache=true on the demo checkpoint prints what the quantized engine
  generates in this process for the same prompt and config (one device, greedy)."""
  args = overrides(*demo["common"], *DECODE, "quantize_kvcache=true", "kv_quant_axis=dkv", "prompt=And the LORD said")
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
  proc = run([sys.executable, "MaxText/decode.py", BASE_YML, *args], env)
  assert proc.returncode == 0, proc.stderr
  printed = re.search(r"Input `And the LORD said` -> `(.*)`", proc.stdout + proc.stderr, re.S)
  assert printed, proc.stdout + proc.stderr
  cfg = config(*demo["common"], *DECODE, "quantize_kvcache=true", "kv_quant_axis=dkv")
  engine = engine_lib.Engine(cfg, demo["mesh"], demo["params"])
  (ids,) = prompts_lib.prompt_tokens(cfg, demo["tokenizer"], ["And the LORD said"])
  (result,) = engine.generate([engine_lib.Request(tuple(ids), cfg.max_target_length - cfg.max_prefill_predict_length)])
  # decode.py prints the text the tokens add after the prompt (a first "▁word" keeps its space): the whole decode's
  # text past the prompt's own.
  decode = demo["tokenizer"].decode
  whole, prompt = decode([*ids, *result.tokens]), decode(list(ids))
  assert printed.group(1) == whole[len(os.path.commonprefix([prompt, whole])) :]


# ------------------------------------------------------------------------------------------ sharding
@pytest.mark.parametrize("axis", ["dkv", pytest.param("heads_and_dkv", marks=pytest.mark.slow)])
@pytest.mark.mesh
def test_sharded_int8_cache_decodes_as_one_device(axis):
  """fsdp=4 x tensor=2 on 8 devices with the int8 cache: the same tokens and logprobs as one device; the int8
  values' kv heads are split over tensor as the float pool's are, and so are dkv's per-head scales, while
  heads_and_dkv's per-token scales are whole on every tensor shard."""
  one = config(*DECODE, "per_device_batch_size=8", "quantize_kvcache=true", f"kv_quant_axis={axis}")
  eight = config(*DECODE, "per_device_batch_size=1", "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2",
                 "quantize_kvcache=true", f"kv_quant_axis={axis}", num_devices=8)  # fmt: skip
  rng = np.random.default_rng(0)
  prompts = [tuple(int(t) for t in rng.integers(1, one.vocab_size, n)) for n in (4, 12, 7, 1, 20, 9, 16, 3)]
  engine8 = assert_sharded_decode_equals_one_device(one, eight, _params(one), prompts)
  split = sharding.logical_to_mesh_spec((ct.LAYERS, None, None, ct.CACHE_HEADS, ct.CACHE_KV), eight)
  whole = sharding.logical_to_mesh_spec((ct.LAYERS, None, None, None, None), eight)
  for q in engine8.pool:
    assert q.values.sharding.spec == split and split[3] in ("tensor", ("tensor",))
    assert q.values.addressable_shards[0].data.shape[3] == eight.num_kv_heads // 2
    heads = q.scales.addressable_shards[0].data.shape[3]
    if axis == "dkv":
      assert q.scales.sharding.spec == split and heads == eight.num_kv_heads // 2
    else:
      assert q.scales.sharding.spec == whole and heads == 1


def test_train_py_refuses_the_int8_cache_it_would_not_use(tmp_path, capsys):
  """quantize_kvcache is an inference key: train.py has no KV cache unless it decodes RL rollouts, so it refuses it in
  one line (it was accepted and did nothing)."""
  args = overrides("quantize_kvcache=true", f"base_output_directory={tmp_path}", "steps=1")
  assert train.main(["train.py", BASE_YML, *args]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: quantize_kvcache=true quantizes the KV cache of decoding") and err.count("\n") == 1
  assert not os.listdir(tmp_path)  # refused before the run wrote anything
