"""Decoding: the KV cache against full recomputation, sampling against numpy, batching, sharding, the CLI."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from MaxText import common_types as ct
from MaxText import decode, generate_param_only_checkpoint, inference_microbenchmark, sharding, train, train_tokenizer
from MaxText.inference import decoding
from MaxText.inference.sampling import Sampling, sample
from MaxText.layers import models
from MaxText.tests.helpers import BASE_YML, assert_sharded_decode_equals_one_device, config, flip_a_stored_bit, overrides

DECODE = ("max_target_length=48", "max_prefill_predict_length=32", "per_device_batch_size=1")


def _params(cfg):
  model = models.Transformer(cfg)
  tokens, segments, positions = models.init_inputs(1, cfg.max_target_length)
  return model, nn.meta.unbox(model.init({"params": jax.random.key(0)}, tokens, segments, positions))["params"]


def _decoder(cfg, devices=1):
  return decoding.Decoder(cfg, sharding.create_mesh(cfg, jax.devices()[:devices]))


def _prompts(cfg, lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.integers(1, cfg.vocab_size, n).astype(np.int32) for n in lengths]


def _full_forward_greedy(model, params, prompt, n):
  """Greedy decoding by recomputing the whole forward pass at each step: (tokens, logits of each step).

  The sequence is right-padded to a fixed length (padding is causally after it) so one compile serves.
  """
  seq, logits = list(prompt), []
  width = len(prompt) + n
  forward = jax.jit(lambda t, s: model.apply({"params": params}, t, s, jnp.arange(width)[None]))
  for _ in range(n):
    tokens = np.zeros((1, width), np.int32)
    tokens[0, : len(seq)] = seq
    out = np.asarray(forward(tokens, (tokens * 0 + 1) * (np.arange(width) < len(seq))))[0, len(seq) - 1]
    logits.append(out)
    seq.append(int(np.argmax(out)))
  return np.asarray(seq[len(prompt) :]), np.stack(logits)


@pytest.mark.parametrize("scan", ["true", "false"])
def test_cache_matches_full_forward_token_for_token(scan):
  """Prefill + cached steps give the full forward's logits (float32, rtol 1e-5), and the compiled generate
  loop gives greedy full recomputation's tokens, with GQA, scanned or unrolled."""
  cfg = config(*DECODE, f"scan_layers={scan}")
  model, params = _params(cfg)
  dec = _decoder(cfg)
  prompt = _prompts(cfg, [11])[0]
  n = cfg.max_target_length - cfg.max_prefill_predict_length
  want_tokens, want_logits = _full_forward_greedy(model, params, prompt, n)

  tokens, lengths = decoding.pad_prompts([prompt], 1, cfg.max_prefill_predict_length)
  logits, cache = dec.prefill(params, *dec.put_batch(tokens, lengths))
  got = [np.asarray(logits[0])]
  for token in want_tokens[:-1]:
    logits, cache = dec.step(params, cache, jnp.asarray([token], jnp.int32))
    got.append(np.asarray(logits[0]))
  np.testing.assert_allclose(np.stack(got), want_logits, rtol=1e-5, atol=1e-5)

  assert np.array_equal(dec.decode(params, [prompt])[0], want_tokens)


def test_prompt_lengths_share_compiled_programs():
  """Prompts in one bucket reuse one prefill program; the generate loop compiles once for every bucket."""
  cfg = config(*DECODE)
  _, params = _params(cfg)
  dec = _decoder(cfg)
  for lengths, prefills in (([5], 1), ([9], 1), ([16], 1), ([17], 2), ([30], 2)):
    dec.decode(params, _prompts(cfg, lengths))
    assert dec.prefill._cache_size() == prefills, lengths
    assert dec.generate._cache_size() == 1, lengths


def test_generate_stops_at_eos():
  cfg = config(*DECODE)
  _, params = _params(cfg)
  prompt = _prompts(cfg, [7])[0]
  full = _decoder(cfg).decode(params, [prompt])[0]
  eos = int(full[5])
  first = int(np.flatnonzero(full == eos)[0])
  stopped = decoding.Decoder(cfg, sharding.create_mesh(cfg, jax.devices()[:1]), eos_id=eos).decode(params, [prompt])[0]
  assert np.array_equal(stopped, full[:first])


def test_ids_beyond_the_tokenizer_are_never_sampled():
  """A tokenizer smaller than vocab_size: decoding samples only ids it can turn into text."""
  cfg = config(*DECODE, "decode_sampling_strategy=weighted", "decode_sampling_temperature=5.0")
  _, params = _params(cfg)
  mesh = sharding.create_mesh(cfg, jax.devices()[:1])
  out = decoding.Decoder(cfg, mesh, num_tokens=10).decode(params, _prompts(cfg, [4]))[0]
  assert len(out) == 16 and out.max() < 10


# ------------------------------------------------------------------------------------------ sampling
def _logits(vocab=50, rows=4, seed=0):
  return jax.random.normal(jax.random.key(seed), (rows, vocab)) * 3.0


def _draws(logits, sampling, n=200):
  """[n, rows]: draw i with jax.random.key(i), all n in one compiled call."""
  keys = jax.vmap(jax.random.key)(jnp.arange(n))
  return np.asarray(jax.jit(jax.vmap(lambda key: sample(logits, key, sampling)))(keys))


def test_temperature_to_zero_is_greedy():
  logits = _logits()
  greedy = np.argmax(np.asarray(logits), axis=-1)
  for strategy in ("weighted", "topk", "nucleus"):
    for temperature in (0.0, 1e-4):
      draws = _draws(logits, Sampling(strategy, temperature=temperature), n=20)
      assert (draws == greedy).all(), (strategy, temperature)


def test_topk_samples_only_the_k_most_likely():
  logits = _logits()
  k = 5
  allowed = np.argsort(-np.asarray(logits, np.float64), axis=-1)[:, :k]
  draws = _draws(logits, Sampling("topk", temperature=2.0, top_k=k))
  for row in range(logits.shape[0]):
    assert set(draws[:, row]) <= set(allowed[row])
    assert len(set(draws[:, row])) > 1, "the check must be able to fail: more than one token is drawn"


def test_nucleus_samples_only_the_smallest_set_reaching_p():
  logits = _logits()
  p = 0.6
  probs = np.exp(np.asarray(logits, np.float64))
  probs /= probs.sum(-1, keepdims=True)
  draws = _draws(logits, Sampling("nucleus", temperature=1.0, nucleus_p=p))
  for row in range(logits.shape[0]):
    order = np.argsort(-probs[row])
    size = int(np.searchsorted(np.cumsum(probs[row][order]), p) + 1)  # smallest prefix with mass >= p
    assert set(draws[:, row]) <= set(order[:size])


def test_weighted_sampling_follows_the_softmax():
  logits = jnp.asarray([[0.0, 1.0, 2.0, -1.0]])
  draws = _draws(logits, Sampling("weighted", temperature=1.0), n=3000)[:, 0]
  probs = np.exp(np.asarray(logits[0], np.float64))
  probs /= probs.sum()
  freq = np.bincount(draws, minlength=4) / len(draws)
  sigma = np.sqrt(probs * (1 - probs) / len(draws))
  assert np.all(np.abs(freq - probs) < 4 * sigma), (freq, probs)


def test_sampling_is_reproducible_with_a_seed():
  cfg = config(*DECODE, "decode_sampling_strategy=weighted", "decode_sampling_temperature=1.5")
  _, params = _params(cfg)
  dec = _decoder(cfg)
  prompts = _prompts(cfg, [5, 9])
  a, b = dec.decode(params, prompts, seed=3), dec.decode(params, prompts, seed=3)
  c = dec.decode(params, prompts, seed=4)
  assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
  assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


@pytest.mark.parametrize("strategy", ["greedy", "weighted"])
def test_a_row_decodes_as_if_alone(strategy):
  """Prompts of different lengths (and an empty padding row) batched give each prompt's output alone."""
  lengths = [3, 30, 9]
  batched_cfg = config(*DECODE, "per_device_batch_size=4", f"decode_sampling_strategy={strategy}")
  alone_cfg = config(*DECODE, f"decode_sampling_strategy={strategy}")
  _, params = _params(batched_cfg)
  prompts = _prompts(batched_cfg, lengths)
  batched = _decoder(batched_cfg).decode(params, prompts)
  alone = [_decoder(alone_cfg).decode(params, [p])[0] for p in prompts]
  for x, y in zip(batched, alone, strict=True):
    assert np.array_equal(x, y)
    assert len(x) == batched_cfg.max_target_length - batched_cfg.max_prefill_predict_length


def test_sharded_decode_equals_single_device():
  """fsdp=4 x tensor=2 on 8 devices: the cache's batch and kv heads are sharded; same logits and tokens."""
  one = config(*DECODE, "per_device_batch_size=8")
  eight = config(*DECODE, "per_device_batch_size=1", "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2", num_devices=8)
  _, params = _params(one)
  cache8 = assert_sharded_decode_equals_one_device(one, eight, params, _prompts(one, [4, 12, 7, 1, 20, 9, 16, 3]))
  assert cache8.keys.sharding.spec == sharding.logical_to_mesh_spec((ct.LAYERS, *ct.CACHE_AXES), eight)
  assert len(cache8.keys.sharding.device_set) == 8


# ------------------------------------------------------------------------------------------ the CLI
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """A 2-step training run with a checkpoint, and a SentencePiece tokenizer."""
  root = tmp_path_factory.mktemp("decode")
  texts = [f"The {w} of the {v} is {n} and the {v} of the {w} is {n + 1}." for n in range(60) for w, v in [("sun", "sea")]]
  train_tokenizer.train(texts * 5, vocab_size=300, output=str(root / "tok.model"))
  common = ("vocab_size=512", "override_model_config=true", f"base_output_directory={root}", "enable_checkpointing=true")
  train.train(config(*common, "run_name=run", "steps=2", "async_checkpointing=false", num_devices=8))
  args = (*common, f"tokenizer_path={root}/tok.model", *DECODE)
  return root, args


def _run(main, args, capsys):
  code = main(["prog", BASE_YML, *overrides(*args)])
  out, err = capsys.readouterr()
  return code, out, err


@pytest.mark.slow
def test_cli_decodes_from_run_and_from_unrolled_params_only_checkpoint(trained, capsys):
  root, args = trained
  code, out, err = _run(decode.main, (*args, "run_name=run", "prompt=The sun"), capsys)
  assert code == 0, err
  line = next(x for x in out.splitlines() if x.startswith("Input `The sun` -> `"))
  assert "ms per generated token" in out and "tokens/s" in out

  source = f"load_full_state_path={root}/run/checkpoints/2/items"
  code, _, err = _run(generate_param_only_checkpoint.main, (*args, "run_name=params", source, "force_unroll=true"), capsys)
  assert code == 0, err
  params_only = f"load_parameters_path={root}/params/checkpoints/0/items"
  code, out, err = _run(decode.main, (*args, "run_name=other", params_only, "scan_layers=false", "prompt=The sun"), capsys)
  assert code == 0, err
  assert line in out.splitlines()  # the unrolled copy decodes exactly as the scanned original

  output = line.split("-> `", 1)[1][:-1]
  assert (
    _run(decode.main, (*args, "run_name=run", "prompt=The sun", f"autoregressive_decode_assert={output[:5]}"), capsys)[0]
    == 0
  )
  code, _, err = _run(decode.main, (*args, "run_name=run", "prompt=The sun", "autoregressive_decode_assert=zzz"), capsys)
  assert code == 1 and "does not start with 'zzz'" in err

  code, _, err = _run(generate_param_only_checkpoint.main, (*args, "run_name=params", source), capsys)
  assert code == 2 and "already holds checkpoints" in err  # never overwritten

  flip_a_stored_bit(f"{root}/params/checkpoints/0", "params.decoder_norm.scale")  # Refused, not decoded differently.
  code, out, err = _run(decode.main, (*args, "run_name=other", params_only, "scan_layers=false", "prompt=The sun"), capsys)
  assert code == 2 and f"checkpoint {root}/params/checkpoints/0 is damaged: params.decoder_norm.scale differs" in err, err
  assert len(err.strip().splitlines()) == 1 and "Input `" not in out


@pytest.mark.slow  # A benchmark run end to end; the decoder's numerics are the cache tests' (quick loop).
def test_microbenchmark_reports_times_and_bandwidth(trained, tmp_path, capsys):
  root, args = trained
  log = tmp_path / "bench.json"
  bench = (
    "inference_microbenchmark_prefill_lengths=8,32",
    "inference_microbenchmark_batch_sizes=8",
    "inference_microbenchmark_loop_iters=2",
    "memory_bandwidth_gbps=100",
    f"inference_microbenchmark_log_file_path={log}",
  )
  code, out, err = _run(inference_microbenchmark.main, (*args, "run_name=run", *bench), capsys)
  assert code == 0, err
  rows = json.loads(log.read_text())["results"]
  assert [(r["batch"], r["prefill_length"]) for r in rows] == [(8, 8), (8, 32)]
  for r in rows:
    assert r["prefill_ms"] > 0 and r["step_ms"] > 0 and r["loop_tokens_per_s"] > 0
    assert r["bandwidth_fraction"] == pytest.approx(r["bytes_per_step"] / (r["step_ms"] / 1e3) / 1e9 / 8 / 100)
  bad = ("run_name=run", "inference_microbenchmark_prefill_lengths=8", "inference_microbenchmark_batch_sizes=3")
  code, _, err = _run(inference_microbenchmark.main, (*args, *bad), capsys)
  assert code == 2 and "must split over the 8 data x fsdp shards" in err


@pytest.mark.parametrize(
  "extra, message",
  [
    (("run_name=run", "prompt=" + "word " * 40), "max_prefill_predict_length=32"),
    (("run_name=nothing",), "no parameters to load"),
    (("run_name=x", "load_parameters_path={root}/missing/items"), "does not exist"),
    (("run_name=run", "base_emb_dim=64"), "use the model config it was saved with"),
    (("run_name=run", "decode_sampling_strategy=beam"), "decode_sampling_strategy='beam' is not supported"),
    (("run_name=run", "max_prefill_predict_length=48"), "leaves no room to generate"),
    (("run_name=run", "tokenizer_path={root}/none.model"), "does not exist"),
  ],
)
def test_cli_bad_input_is_one_line_and_exit_2(trained, capsys, extra, message):
  root, args = trained
  code, _, err = _run(decode.main, (*args, *(e.format(root=root) for e in extra)), capsys)
  assert code == 2
  assert message in err and len(err.strip().splitlines()) == 1, err


def test_a_prompts_file_that_is_not_utf8_is_one_line(trained, capsys, tmp_path):
  _, args = trained
  prompts = tmp_path / "prompts.txt"
  prompts.write_bytes("caf\xe9 au lait\n".encode("latin-1"))
  code, _, err = _run(decode.main, (*args, "run_name=run", f"decode_prompts_file={prompts}"), capsys)
  assert code == 2 and "is not UTF-8 text (byte 3)" in err and len(err.strip().splitlines()) == 1, err


def test_context_parallel_decode_equals_single_device():
  """Sequences split over context=4 x tensor=2 (prefill attends across the pieces): same logits and tokens."""
  one = config(*DECODE, "per_device_batch_size=8")
  eight = config(
    *DECODE,
    "per_device_batch_size=1",
    "ici_fsdp_parallelism=1",
    "ici_context_parallelism=4",
    "ici_tensor_parallelism=2",
    num_devices=8,
  )
  _, params = _params(one)
  assert_sharded_decode_equals_one_device(one, eight, params, _prompts(one, [4, 12, 7, 1, 20, 9, 16, 3]))


def test_pipeline_parallel_layout_decodes_as_single_device():
  """A pipeline-parallel training layout (stage=2 x fsdp=4: the layers' weights split over the stages) decodes
  with the same logits and tokens; decoding itself runs the layers in order."""
  one = config(*DECODE, "per_device_batch_size=8")
  eight = config(*DECODE, "per_device_batch_size=1", "ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4", num_devices=8)
  _, params = _params(one)
  assert_sharded_decode_equals_one_device(one, eight, params, _prompts(one, [4, 12, 7, 1, 20, 9, 16, 3]))


def test_visible_escapes_every_control_character_but_newline():
  """Against a hand-written table: C0 (tab and CR as \\t, \\r), DEL, C1 and the bidirectional overrides become
  escapes; newlines, printable ASCII and other Unicode (CJK, emoji with a zero-width joiner) stay."""
  bidi = [0x202A, 0x202B, 0x202C, 0x202D, 0x202E, 0x2066, 0x2067, 0x2068, 0x2069]
  for code in [*range(0x00, 0x300), *bidi, 0x200D, 0x3000, 0x65E5, 0x1F642]:
    c = chr(code)
    if c == "\n" or (0x20 <= code < 0x7F) or (code >= 0xA0 and code not in bidi):
      want = c
    elif c in "\t\r":
      want = {"\t": "\\t", "\r": "\\r"}[c]
    else:
      want = f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"
    assert decode.visible(c) == want, hex(code)
  assert decode.visible("\x1b]0;title\x07 a\\b\n日本 👨\u200d👩") == "\\x1b]0;title\\x07 a\\b\n日本 👨\u200d👩"


def test_cli_prints_prompts_and_outputs_without_raw_control_characters(trained, capsys, tmp_path):
  """A prompts file with an OSC title sequence, BEL, a bare CR, DEL, C1 and a CRLF line end: every character
  decode.py prints is printable or a newline, and the prompt shows as its escapes (the CRLF's CR is the line end)."""
  import unicodedata

  _, args = trained
  prompts = tmp_path / "prompts.txt"
  prompts.write_bytes("\x1b]0;pwned\x07The sun\x1b[2J\r\nThe \x7fsea\x9b\rX\n".encode())
  code, out, err = _run(decode.main, (*args, "run_name=run", f"decode_prompts_file={prompts}"), capsys)
  assert code == 0, err
  raw = [hex(ord(c)) for c in out if c != "\n" and unicodedata.category(c) == "Cc"]
  assert not raw, raw
  lines = [line for line in out.splitlines() if line.startswith("Input `")]
  assert [line.split("` -> `")[0] for line in lines] == [
    "Input `\\x1b]0;pwned\\x07The sun\\x1b[2J",
    "Input `The \\x7fsea\\x9b\\rX",
  ]


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "folder"])
def test_a_prompts_file_that_is_not_a_regular_file_is_never_opened(trained, capsys, tmp_path, kind):
  from MaxText.tests.helpers import deadline

  _, args = trained
  path = {"fifo": tmp_path / "prompts", "dev-zero": "/dev/zero", "folder": tmp_path}[kind]
  if kind == "fifo":
    os.mkfifo(path)
  with deadline(60):
    code, out, err = _run(decode.main, (*args, "run_name=run", f"decode_prompts_file={path}"), capsys)
  words = {"fifo": "a FIFO", "dev-zero": "a character device", "folder": "a folder"}[kind]
  assert code == 2 and f"decode_prompts_file={path} is not a regular file (it is {words})" in err, err
  assert len(err.strip().splitlines()) == 1 and "Input `" not in out
