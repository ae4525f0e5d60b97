"""Decoding through the engine: the KV cache against full recomputation (tokens and logprobs), sampling against
numpy, batching, sharding, the CLI."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from MaxText import common_types as ct
from MaxText import decode, generate_param_only_checkpoint, inference_microbenchmark, sharding, train, train_tokenizer
from MaxText.inference import engine as engine_lib
from MaxText.inference.sampling import Sampling, sample_rows
from MaxText.layers import models
from MaxText.tests.helpers import BASE_YML, assert_sharded_decode_equals_one_device, config, flip_a_stored_bit, overrides

DECODE = ("max_target_length=48", "max_prefill_predict_length=32", "per_device_batch_size=1")


def _params(cfg):
  model = models.Transformer(cfg)
  tokens, segments, positions = models.init_inputs(1, cfg.max_target_length)
  return model, nn.meta.unbox(model.init({"params": jax.random.key(0)}, tokens, segments, positions))["params"]


def _engine(cfg, params, devices=1, **options):
  return engine_lib.Engine(cfg, sharding.create_mesh(cfg, jax.devices()[:devices]), params, **options)


def _prompts(cfg, lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [tuple(int(t) for t in rng.integers(1, cfg.vocab_size, n)) for n in lengths]


def _generate(engine, prompts, cfg, **settings):
  """Each prompt's generated tokens (max_target_length - max_prefill_predict_length at most), as decode.py asks."""
  n = cfg.max_target_length - cfg.max_prefill_predict_length
  return [r.tokens for r in engine.generate([engine_lib.Request(p, n, **settings) for p in prompts])]


_FORWARDS = {}  # (id of the model, width) -> (the model, its jitted forward), so calls of one width share a compile


def _full_forward_greedy(model, params, prompt, n, width=None):
  """Greedy decoding by recomputing the whole forward pass at each step: (tokens, logits [prompt + n, vocab] of
  every position of the prompt and the generated tokens, the last one's excluded).

  The sequence is right-padded to a fixed length, `width` (default prompt + n; padding is causally after it), so one
  compile serves every step, and every call with the same model and width.
  """
  seq = list(prompt)
  width = width or len(prompt) + n
  known, forward = _FORWARDS.get((id(model), width), (None, None))
  if known is not model:
    forward = jax.jit(lambda p, t, s: model.apply({"params": p}, t, s, jnp.arange(width)[None]))
    _FORWARDS[(id(model), width)] = (model, forward)
  for _ in range(n):
    tokens = np.zeros((1, width), np.int32)
    tokens[0, : len(seq)] = seq
    logits = np.asarray(forward(params, tokens, (tokens * 0 + 1) * (np.arange(width) < len(seq))))[0]
    seq.append(int(np.argmax(logits[len(seq) - 1])))
  return seq[len(prompt) :], logits[: len(prompt) + n - 1]


def _log_softmax(logits):
  """float64 log-softmax over the last axis, in numpy (the reference the engine's logprobs are checked against)."""
  logits = np.asarray(logits, np.float64)
  shifted = logits - logits.max(-1, keepdims=True)
  return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def _assert_logprobs(got, want_lp, targets, k):
  """Engine TokenLogprobs `got` against reference logprobs [n, vocab]: each target's logprob, and the top k ids
  (most likely first) with their logprobs (float32 against float64: rtol and atol 1e-5)."""
  assert len(got) == len(targets)
  for i, (lp, target) in enumerate(zip(got, targets, strict=True)):
    top = np.argsort(-want_lp[i], kind="stable")[:k]
    assert [t for t, _ in lp.top] == list(top), i
    np.testing.assert_allclose(
      [lp.logprob, *(x for _, x in lp.top)], [want_lp[i, target], *want_lp[i, top]], rtol=1e-5, atol=1e-5, err_msg=i
    )


@pytest.mark.parametrize("scan", ["true", "false"])
def test_cache_matches_full_forward_token_for_token(scan):
  """The engine (prefill, then cached steps in the compiled loop) gives greedy full recomputation's tokens, and its
  logprobs are the full forward's: the prompt's (echo: the prefill's logits) and each generated token's with the 5
  most likely (the cached steps' logits), with GQA, scanned or unrolled."""
  cfg = config(*DECODE, f"scan_layers={scan}")
  model, params = _params(cfg)
  prompt = _prompts(cfg, [11])[0]
  n = cfg.max_target_length - cfg.max_prefill_predict_length
  want_tokens, want_logits = _full_forward_greedy(model, params, prompt, n)
  want = _log_softmax(want_logits)

  (result,) = _engine(cfg, params).generate([engine_lib.Request(prompt, n, logprobs=5, echo=True)])
  assert result.tokens == want_tokens and result.finish_reason == "length"
  assert result.prompt_logprobs[0] is None
  _assert_logprobs(result.prompt_logprobs[1:], want[: len(prompt) - 1], prompt[1:], 5)
  _assert_logprobs(result.logprobs, want[len(prompt) - 1 :], want_tokens, 5)


def test_prompt_lengths_share_compiled_programs():
  """Prompts in one bucket reuse one prefill program; the generate loop compiles once for every bucket (nothing is
  compiled for a prompt whose bucket ran before: the engine's compile time stays the same)."""
  cfg = config(*DECODE)
  _, params = _params(cfg)
  engine = _engine(cfg, params)
  for lengths, compiles in (([5], True), ([9], False), ([16], False), ([17], True), ([30], False)):
    before = engine.stats["compile_seconds"]
    _generate(engine, _prompts(cfg, lengths), cfg)
    assert (engine.stats["compile_seconds"] > before) == compiles, lengths


def test_generate_stops_at_eos():
  cfg = config(*DECODE)
  _, params = _params(cfg)
  prompt = _prompts(cfg, [7])[0]
  full = _generate(_engine(cfg, params), [prompt], cfg)[0]
  eos = full[5]
  first = full.index(eos)
  (stopped,) = _engine(cfg, params, end_ids=[eos]).generate([engine_lib.Request(prompt, len(full))])
  assert stopped.tokens == full[:first] and stopped.finish_reason == "stop"


def test_ids_beyond_the_tokenizer_are_never_sampled():
  """A tokenizer smaller than vocab_size: decoding samples only ids it can turn into text."""
  cfg = config(*DECODE)
  _, params = _params(cfg)
  prompt = (3, 1, 4, 1)  # a prompt the tokenizer can write
  out = _generate(_engine(cfg, params, num_tokens=10), [prompt], cfg, temperature=5.0, seed=0)[0]
  assert len(out) == 16 and max(out) < 10


# ------------------------------------------------------------------------------------------ sampling
def _logits(vocab=50, rows=4, seed=0):
  return jax.random.normal(jax.random.key(seed), (rows, vocab)) * 3.0


def _draws(logits, temperature, top_k=0, top_p=1.0, n=200):
  """[n, rows]: sample_rows with per-row settings (a scalar is every row's); draw i gives row r the key
  fold_in(key(i), r); all n in one compiled call."""
  rows = logits.shape[0]
  settings = [jnp.broadcast_to(jnp.asarray(v, dtype), (rows,)) for v, dtype in
              ((temperature, jnp.float32), (top_k, jnp.int32), (top_p, jnp.float32))]  # fmt: skip
  keys = jax.vmap(lambda i: jax.vmap(lambda r: jax.random.fold_in(jax.random.key(i), r))(jnp.arange(rows)))(jnp.arange(n))
  return np.asarray(jax.jit(jax.vmap(lambda k: sample_rows(logits, k, *settings)))(keys))


def test_temperature_to_zero_is_greedy():
  """Rows at temperature 0 and 1e-4, plain, top-k and nucleus, in one batch: every draw is the argmax."""
  logits = _logits(rows=6)
  greedy = np.argmax(np.asarray(logits), axis=-1)
  draws = _draws(logits, [0.0, 1e-4, 0.0, 1e-4, 0.0, 1e-4], [0, 0, 5, 5, 0, 0], [1.0, 1.0, 1.0, 1.0, 0.9, 0.9], n=20)
  assert (draws == greedy).all()


def test_topk_samples_only_the_k_most_likely():
  """Each row its own k (1, 3, 5, 8) at temperature 2: draws only from that row's k most likely tokens."""
  logits = _logits()
  ks = [1, 3, 5, 8]
  draws = _draws(logits, 2.0, top_k=ks)
  order = np.argsort(-np.asarray(logits, np.float64), axis=-1)
  for row, k in enumerate(ks):
    assert set(draws[:, row]) <= set(order[row, :k])
    if k > 1:
      assert len(set(draws[:, row])) > 1, "the check must be able to fail: more than one token is drawn"


def test_nucleus_samples_only_the_smallest_set_reaching_p():
  """Each row its own p (0.3, 0.6, 0.6, 0.9): draws only from that row's smallest set of most likely tokens whose
  mass reaches p."""
  logits = _logits()
  ps = [0.3, 0.6, 0.6, 0.9]
  probs = np.exp(np.asarray(logits, np.float64))
  probs /= probs.sum(-1, keepdims=True)
  draws = _draws(logits, 1.0, top_p=ps)
  for row, p in enumerate(ps):
    order = np.argsort(-probs[row])
    size = int(np.searchsorted(np.cumsum(probs[row][order]), p) + 1)  # smallest prefix with mass >= p
    assert set(draws[:, row]) <= set(order[:size])


def test_weighted_sampling_follows_the_softmax():
  """Rows at temperature 1 and 2 draw with the frequencies of softmax(logits / temperature), within 4 sigma."""
  logits = jnp.asarray([[0.0, 1.0, 2.0, -1.0]] * 2)
  draws = _draws(logits, [1.0, 2.0], n=3000)
  for row, temperature in enumerate([1.0, 2.0]):
    probs = np.exp(np.asarray(logits[row], np.float64) / temperature)
    probs /= probs.sum()
    freq = np.bincount(draws[:, row], minlength=4) / len(draws)
    sigma = np.sqrt(probs * (1 - probs) / len(draws))
    assert np.all(np.abs(freq - probs) < 4 * sigma), (row, freq, probs)


def test_a_row_samples_as_if_alone():
  """sample_rows: a row's draw depends on its own logits, key and settings only, not on the rows beside it (which
  may be greedy, filtered or not)."""
  logits = _logits(rows=4)
  keys = jax.vmap(lambda r: jax.random.fold_in(jax.random.key(7), r))(jnp.arange(4))
  temperature, top_k, top_p = jnp.asarray([1.5, 0.0, 0.7, 1.0]), jnp.asarray([0, 0, 4, 0]), jnp.asarray([1, 1, 1, 0.8])
  batched = np.asarray(sample_rows(logits, keys, temperature, top_k, top_p))
  for row in range(4):
    alone = sample_rows(logits[row : row + 1], keys[row : row + 1], temperature[row : row + 1], top_k[row : row + 1],
                        top_p[row : row + 1])  # fmt: skip
    assert int(alone[0]) == batched[row], row


def test_sampling_is_reproducible_with_a_seed():
  cfg = config(*DECODE)
  _, params = _params(cfg)
  engine = _engine(cfg, params)
  prompts = _prompts(cfg, [5, 9])
  a, b = (_generate(engine, prompts, cfg, temperature=1.5, seed=3) for _ in range(2))
  c = _generate(engine, prompts, cfg, temperature=1.5, seed=4)
  assert a == b and a != c


@pytest.mark.parametrize("strategy", ["greedy", "weighted"])
def test_a_row_decodes_as_if_alone(strategy):
  """Prompts of different lengths generating together in 4 slots (one idle) give each prompt's output alone."""
  lengths = [3, 30, 9]
  batched_cfg = config(*DECODE, "per_device_batch_size=4", f"decode_sampling_strategy={strategy}")
  alone_cfg = config(*DECODE, f"decode_sampling_strategy={strategy}")
  _, params = _params(batched_cfg)
  prompts = _prompts(batched_cfg, lengths)
  temperature, top_k, top_p = Sampling.from_config(batched_cfg).request_settings()
  settings = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": 5}
  batched = _generate(_engine(batched_cfg, params), prompts, batched_cfg, **settings)
  alone = [_generate(_engine(alone_cfg, params), [p], alone_cfg, **settings)[0] for p in prompts]
  assert batched == alone
  assert all(len(x) == batched_cfg.max_target_length - batched_cfg.max_prefill_predict_length for x in batched)


@pytest.mark.mesh
def test_sharded_decode_equals_single_device():
  """fsdp=4 x tensor=2 on 8 devices: the paged cache's kv heads are split over tensor (pages and their tokens are
  not split); same tokens and logprobs."""
  one = config(*DECODE, "per_device_batch_size=8")
  eight = config(*DECODE, "per_device_batch_size=1", "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2", num_devices=8)
  _, params = _params(one)
  engine8 = assert_sharded_decode_equals_one_device(one, eight, params, _prompts(one, [4, 12, 7, 1, 20, 9, 16, 3]))
  spec = sharding.logical_to_mesh_spec((ct.LAYERS, None, None, ct.CACHE_HEADS, ct.CACHE_KV), eight)
  for pool in engine8.pool:
    assert pool.sharding.spec == spec and spec[3] in ("tensor", ("tensor",))
    assert pool.addressable_shards[0].data.shape[3] == eight.num_kv_heads // 2


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
@pytest.mark.mesh
def test_cli_bad_input_is_one_line_and_exit_2(trained, capsys, extra, message):
  root, args = trained
  code, _, err = _run(decode.main, (*args, *(e.format(root=root) for e in extra)), capsys)
  assert code == 2
  assert message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.mesh
def test_a_prompts_file_that_is_not_utf8_is_one_line(trained, capsys, tmp_path):
  _, args = trained
  prompts = tmp_path / "prompts.txt"
  prompts.write_bytes("caf\xe9 au lait\n".encode("latin-1"))
  code, _, err = _run(decode.main, (*args, "run_name=run", f"decode_prompts_file={prompts}"), capsys)
  assert code == 2 and "is not UTF-8 text (byte 3)" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.mesh
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


@pytest.mark.mesh
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


@pytest.mark.mesh
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


@pytest.mark.mesh
def test_cli_prints_each_output_after_its_prompt_and_counts_in_words(trained, capsys):
  """decode.py prints the text its output tokens add after its prompt's tokens (decode(prompt + output) past
  decode(prompt), from the engine's tokens run here), and its figures count in words: "1 prompt" (before: "1
  prompt(s)", and "(1 slots)" for one slot)."""
  import os as os_lib

  from MaxText.inference import prompts as prompts_lib

  _, args = trained
  code, out, err = _run(decode.main, (*args, "run_name=run", "prompt=The sun"), capsys)
  assert code == 0, err
  cfg = config(*args, "run_name=run", "prompt=The sun", num_devices=8)
  engine, tokenizer = engine_lib.Engine.from_config(cfg)
  ids = prompts_lib.prompt_tokens(cfg, tokenizer, ["The sun"])[0]
  (result,) = engine.generate([engine_lib.Request(tuple(ids), cfg.max_target_length - cfg.max_prefill_predict_length)])
  whole, before = tokenizer.decode(ids + result.tokens), tokenizer.decode(ids)
  want = whole[len(os_lib.path.commonprefix([whole, before])) :]
  assert f"Input `The sun` -> `{decode.visible(want)}`" in out.splitlines()
  figures = next(line for line in out.splitlines() if line.startswith("Prefill: "))
  assert " for 1 prompt; " in figures and f"({engine.num_slots} slots)" in figures, figures
  assert [engine_lib.counted(n, "slot") for n in (0, 1, 2)] == ["0 slots", "1 slot", "2 slots"]


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "folder"])
@pytest.mark.mesh
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
