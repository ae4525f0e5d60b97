"""The continuous-batching engine (inference/engine.py) against references that do not use it: greedy decoding by
the whole uncached forward pass (inference_test._full_forward_greedy), the same engine with one slot running one
request at a time (what decode.py does for one prompt), one forward pass's log-softmax in float64 NumPy, and NumPy's
top-k and nucleus sets.

Every model is float32 at HIGHEST matmul precision (helpers.TINY), so greedy choices do not flip between the cached
and the uncached computations (their logits agree to float32 rounding, 1e-5 in inference_test, far below the gap
between a random model's two most likely tokens). Each test also checks that its reference is not trivially met
(different prompts give different outputs, a stop really cuts, a prefix-cache hit really happened, a sampled request
differs from the greedy one).

The families come from the registry (families.FAMILIES): each one's tiny model is its first hf_example, as
family_training_test builds it, run scanned on one device and unrolled on 8 (_family_cases). QUICK's scanned case on
one device runs in the quick loop; the others are slow-marked (their fast sibling: QUICK's case of
test_every_family_...).
"""

import collections
import dataclasses
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn

from MaxText import families, sharding, state
from MaxText.inference import engine as engine_lib
from MaxText.inference import model_runner
from MaxText.inference import output as output_lib
from MaxText.inference import pages as pages_lib
from MaxText.inference import slots as slots_lib
from MaxText.inference.sampling import sample_rows
from MaxText.layers import models
from MaxText.tests.helpers import config, deadline
from MaxText.tests.inference_test import _full_forward_greedy

# 40 tokens a row, prompts up to 24, pages of 4 (10 a row), 4 steps per compiled call (so slots finish and are
# refilled between calls), 3 slots.
DECODE = (
  "max_target_length=40",
  "max_prefill_predict_length=24",
  "pagedattn_tokens_per_page=4",
  "decode_steps_per_dispatch=4",
  "per_device_batch_size=3",
)
# (prompt length, max_tokens): more requests than slots, a one-token prompt, a one-token output, a prompt as long as
# max_prefill_predict_length, prompts that end on and off page boundaries.
MIXED = ((5, 9), (19, 4), (1, 12), (12, 7), (24, 3), (8, 14), (15, 1))

QUICK = "mistral"  # sliding windows (shorter than the prompts) over GQA: the quick loop's family
TRAINED = sorted(name for name, family in families.FAMILIES.items() if family.hf_examples)


def _params(cfg, seed=0):
  model = models.Transformer(cfg)
  params = model.init({"params": jax.random.key(seed)}, *models.init_inputs(1, cfg.max_target_length))
  return model, nn.meta.unbox(params)["params"]


def _engine(cfg, params, devices=1, **options):
  """An engine on the first `devices` devices, the parameters placed by the config's layout."""
  mesh = sharding.create_mesh(cfg, jax.devices()[:devices])
  if devices > 1:
    _, shardings = state.params_layout(models.Transformer(cfg, mesh), cfg, mesh)
    params = jax.device_put(params, shardings)
  return engine_lib.Engine(cfg, mesh, params, **options)


def _prompts(cfg, lengths, seed=0):
  rng = np.random.default_rng(seed)
  return [tuple(int(t) for t in rng.integers(1, cfg.vocab_size, n)) for n in lengths]


def _requests(cfg, shapes=MIXED, seed=0, **settings):
  prompts = _prompts(cfg, [n for n, _ in shapes], seed)
  return [engine_lib.Request(p, m, **settings) for p, (_, m) in zip(prompts, shapes, strict=True)]


def _alone(keys, params, requests):
  """Each request's result from an engine of config `keys` with one slot, one request at a time (decode.py on one
  prompt)."""
  engine = _engine(config(*keys, "per_device_batch_size=1"), params)
  return [engine.generate([r])[0] for r in requests]


def _full_forward(model, params, requests):
  width = max(len(r.prompt) + r.max_tokens for r in requests)  # one compile for them all
  return [_full_forward_greedy(model, params, r.prompt, r.max_tokens, width)[0] for r in requests]


def _assert_not_trivial(outputs):
  """The reference can fail: different prompts give different outputs, and outputs are not one repeated token."""
  assert len({tuple(o) for o in outputs}) == len(outputs), outputs
  assert any(len(set(o)) > 1 for o in outputs), outputs


def _log_softmax(model, params, tokens):
  """float64 log-softmax [len(tokens), vocab] of one uncached forward pass over `tokens`."""
  tokens = np.asarray(tokens, np.int32)[None]
  logits = model.apply({"params": params}, tokens, np.ones_like(tokens), np.arange(tokens.shape[1])[None])
  logits = np.asarray(logits[0], np.float64)
  shifted = logits - logits.max(-1, keepdims=True)
  return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


# ------------------------------------------------------------------------------------------ greedy references
def test_concurrent_requests_equal_each_alone_and_the_full_forward():
  """MIXED (7 requests of mixed lengths through 3 slots, refilled as they finish) give each request's greedy
  tokens alone and by full recomputation; every request finishes by length."""
  cfg = config(*DECODE)
  model, params = _params(cfg)
  requests = _requests(cfg)
  engine = _engine(cfg, params)
  got = engine.generate(requests)
  want = _full_forward(model, params, requests)
  _assert_not_trivial(want)
  assert [r.tokens for r in got] == want
  assert [r.tokens for r in _alone(DECODE, params, requests)] == want
  assert all(r.finish_reason == "length" for r in got)
  assert engine.stats["tokens"] == sum(m for _, m in MIXED) - len(MIXED)  # all but each prefill's token
  assert engine.pages.held() == 0 and engine.pages.available() == engine.pages.num_pages


def _family_cases():
  """Every family scanned on one device and unrolled on the 8-device mesh: each family runs both scanned and
  unrolled, and both alone and sharded, against references that are the same for all four layouts. The other two
  combinations would double the cost (each case compiles three engines and the reference: 15-20 s in a fresh CI
  run) and test no layout a family lacks. QUICK scanned on one device in the quick loop; the rest slow (their fast
  sibling: that case)."""
  cases = []
  for name in TRAINED:
    for scan, devices in (("true", 1), ("false", 8)):
      quick = (name, scan, devices) == (QUICK, "true", 1)
      cases.append(pytest.param(name, scan, devices, marks=[] if quick else [pytest.mark.slow]))
  return cases


def test_the_quick_family_is_registered_with_examples():
  assert QUICK in TRAINED


# A family's requests: 6 through 4 slots, prompts of at most 16 tokens (one prefill program alone, two chunks of 8).
FAMILY_MIXED = ((5, 6), (14, 3), (1, 7), (16, 4), (9, 8), (11, 1))


@pytest.mark.parametrize(("name", "scan", "devices"), _family_cases())
def test_every_family_generates_concurrently_as_alone_and_as_its_full_forward(name, scan, devices, tmp_path):
  """Each family's tiny model (its windows, chunks, sinks, experts or latent cache), scanned or unrolled, on one
  device or 8 (fsdp 4 x tensor 2, or fsdp 2 x tensor 2 x expert 2 for a mixture of experts): FAMILY_MIXED through 4
  slots, prefilled in chunks of 8 (the cached attention over several new tokens), give the tokens of each request
  alone on one device with one-shot prefill and of greedy full recomputation.

  The output layer is untied (logits_via_embedding=false): a random model with tied embeddings predicts the token it
  reads (its embedding's product with itself dominates the logits), so its outputs would not depend on the cache."""
  pytest.importorskip("transformers")
  from MaxText.tests.family_training_test import tiny_model

  model_keys = (tiny_model(name, tmp_path)[0], f"scan_layers={scan}", "override_model_config=true", *DECODE)
  model_keys += ("logits_via_embedding=false",)
  one = config(*model_keys, "per_device_batch_size=4")
  model, params = _params(one)
  split = ("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2")
  if families.FAMILIES[name].moe:
    split = ("ici_fsdp_parallelism=2", "ici_tensor_parallelism=2", "ici_expert_parallelism=2")
  chunked = ("use_chunked_prefill=true", "prefill_chunk_size=8")
  if devices == 1:
    cfg = config(*model_keys, *chunked, "per_device_batch_size=4")
  else:
    cfg = config(*model_keys, *chunked, *split, "per_device_batch_size=0.5", num_devices=devices)
  assert cfg.micro_batch_size == 4
  requests = _requests(one, shapes=FAMILY_MIXED)
  want = _full_forward(model, params, requests)
  _assert_not_trivial(want)
  got = _engine(cfg, params, devices).generate(requests)
  assert [r.tokens for r in got] == want
  assert [r.tokens for r in _alone(model_keys, params, requests)] == want


@pytest.mark.parametrize("keys", [("pagedattn_tokens_per_page=40",), ("use_chunked_prefill=true", "prefill_chunk_size=4")])
def test_contiguous_and_chunked_prefill_equal_pages_of_4_one_shot(keys):
  """One page per slot (tokens_per_page = max_target_length: a contiguous cache), or prompts prefilled in chunks of
  4 (up to 6 chunks, between the running requests' steps), give the tokens of pages of 4 with one-shot prefill and
  of greedy full recomputation."""
  cfg = config(*DECODE, *keys)
  base = config(*DECODE)
  model, params = _params(base)
  requests = _requests(cfg, seed=1)
  engine = _engine(cfg, params)
  got = [r.tokens for r in engine.generate(requests)]
  assert got == [r.tokens for r in _engine(base, params).generate(requests)]
  want = _full_forward(model, params, requests)
  _assert_not_trivial(want)
  assert got == want
  if cfg.use_chunked_prefill:
    assert engine.pages.page_size == 4
  else:
    assert engine.pages.num_pages == engine.num_slots and engine.pages_per_row == 1


@pytest.mark.parametrize("chunked", ["false", "true"])
def test_a_prefix_cache_hit_gives_the_tokens_of_a_miss(chunked):
  """enable_prefix_caching: a prompt sharing the first 3 pages of an earlier one (and the same prompt again) reuses
  its pages (prefix_hit_tokens counts them) and gives the tokens of full recomputation; a prompt that differs in
  its first token hits nothing. Every page is returned at the end (held by none, cached or free)."""
  keys = ("enable_prefix_caching=true", f"use_chunked_prefill={chunked}", "prefill_chunk_size=8")
  cfg = config(*DECODE, *keys)
  model, params = _params(cfg)
  first = _prompts(cfg, [14], seed=2)[0]
  tail = _prompts(cfg, [7], seed=3)[0]
  prompts = [first, first[:12] + tail, first, (first[0] + 1, *first[1:])]
  hits = [0, 12, 12, 0]  # full pages shared, never the one holding the prompt's last token
  engine = _engine(cfg, params)
  for prompt, hit in zip(prompts, hits, strict=True):
    request = engine_lib.Request(prompt, 6)
    before = engine.stats["prefix_hit_tokens"]
    (got,) = engine.generate([request])
    assert engine.stats["prefix_hit_tokens"] - before == hit
    assert got.tokens == _full_forward(model, params, [request])[0]
    assert engine.pages.held() == 0 and engine.pages.available() == engine.pages.num_pages
  # Together in one batch: the later ones hit the pages the earlier ones left cached.
  requests = [engine_lib.Request(p, 6) for p in prompts]
  assert [r.tokens for r in engine.generate(requests)] == _full_forward(model, params, requests)


def test_memory_follows_the_tokens_held():
  """A pool of 12 pages (one request at max_target_length needs 10; 5 slots would need 50): 4 requests of 6 prompt
  and 6 new tokens (3 pages each) run at once, a fifth waits for pages with a slot free, then runs in the pages
  the others returned; every request gives the tokens of full recomputation."""
  cfg = config(*DECODE, "pagedattn_num_pages=12", "per_device_batch_size=5")
  model, params = _params(cfg)
  engine = _engine(cfg, params)
  assert engine.num_slots * engine.pages_per_row == 50
  requests = _requests(cfg, shapes=((6, 6),) * 5, seed=4)
  results = [engine_lib.Result() for _ in requests]
  for request, result in zip(requests, results, strict=True):
    engine.submit(request, result.add)
  engine.run_once()
  assert [len(r.tokens) > 0 for r in results] == [True] * 4 + [False]  # four slots busy, one free, the fifth waits
  peak = 0
  while engine.busy():
    peak = max(peak, engine.pages.held())
    engine.run_once()
  assert peak == 12 and engine.pages.available() == 12
  assert [r.tokens for r in results] == _full_forward(model, params, requests)


# ------------------------------------------------------------------------------------------ sampling
def _nucleus(probs, p):
  """The smallest set of most likely tokens whose mass reaches p (a token is in while the mass above it is < p)."""
  order = np.argsort(-probs)
  above = np.cumsum(probs[order]) - probs[order]
  return set(order[above < p].tolist())


def test_sample_rows_draws_from_numpy_s_sets_with_their_frequencies():
  """sample_rows, 4000 draws per row of one batch with per-row settings: greedy rows give the argmax; top-k, top-p
  and both draw only inside the set NumPy computes from softmax(logits / temperature), with the renormalised
  frequencies within 5 binomial sigmas (a false alarm has probability < 1e-5 per token)."""
  vocab, draws = 12, 4000
  logits = np.asarray(jax.random.normal(jax.random.key(1), (vocab,)), np.float64) * 2
  # (temperature, top_k, top_p) per row
  rows = [(0.0, 0, 1.0), (0.0, 3, 0.5), (1.0, 0, 1.0), (2.0, 4, 1.0), (1.2, 0, 0.7), (1.5, 5, 0.8)]
  t, k, p = (np.asarray(c) for c in zip(*rows, strict=True))
  keys = jax.random.split(jax.random.key(0), draws * len(rows)).reshape(draws, len(rows))
  batch = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (len(rows), vocab))
  fn = jax.jit(jax.vmap(lambda key: sample_rows(batch, key, jnp.float32(t), jnp.int32(k), jnp.float32(p))))
  out = np.asarray(fn(keys))
  for row, (temperature, top_k, top_p) in enumerate(rows):
    if temperature == 0:
      assert (out[:, row] == np.argmax(logits)).all(), row
      continue
    probs = np.exp(logits / temperature - np.max(logits / temperature))
    probs /= probs.sum()
    allowed = set(range(vocab))
    if top_k:
      allowed &= set(np.argsort(-probs)[:top_k].tolist())
    if top_p < 1:
      allowed &= _nucleus(probs, top_p)
    assert set(out[:, row].tolist()) <= allowed, (row, allowed)
    want = np.zeros(vocab)
    want[list(allowed)] = probs[list(allowed)] / probs[list(allowed)].sum()
    freq = np.bincount(out[:, row], minlength=vocab) / draws
    sigma = np.sqrt(want * (1 - want) / draws)
    assert np.all(np.abs(freq - want) <= 5 * sigma + 1e-9), (row, freq, want)
    assert len(allowed) > 1 and len(set(out[:, row].tolist())) == len(allowed), (row, "every allowed token drawn")


SAMPLED = [
  {"temperature": 1.0},
  {"temperature": 1.5, "top_k": 5},
  {"temperature": 0.8, "top_p": 0.7},
  {"temperature": 2.0, "top_k": 8, "top_p": 0.9},
]


def test_a_seeded_request_is_reproducible_and_independent_of_its_neighbours():
  """Each sampled request (temperature, top-k, top-p, with a seed) gives the same tokens alone in a 1-slot engine,
  in slot 2 of 3 beside other requests (greedy and sampled, of other lengths), and again in another slot; another
  seed gives other tokens."""
  cfg = config(*DECODE)
  _, params = _params(cfg)
  prompt = _prompts(cfg, [9], seed=5)[0]
  neighbours = _requests(cfg, shapes=((3, 14), (17, 5), (6, 12)), seed=6)
  engine = _engine(cfg, params)
  alone_engine = _engine(config(*DECODE, "per_device_batch_size=1"), params)
  for settings in SAMPLED:
    request = engine_lib.Request(prompt, 14, seed=11, **settings)
    alone = alone_engine.generate([request])[0].tokens
    crowded = [neighbours[0], engine_lib.Request(neighbours[1].prompt, 5, temperature=1.0, seed=3), request]
    assert engine.generate(crowded)[2].tokens == alone, settings
    assert engine.generate([request, neighbours[2]])[0].tokens == alone, settings
    other = engine.generate([engine_lib.Request(prompt, 14, seed=12, **settings)])[0].tokens
    assert other != alone, settings
  greedy = engine.generate([engine_lib.Request(prompt, 14)])[0].tokens
  assert alone != greedy  # the last settings really sample


# ------------------------------------------------------------------------------------------ logprobs
@pytest.mark.parametrize("chunked", ["false", "true"])
def test_logprobs_and_echo_equal_the_full_forward_s_log_softmax(chunked):
  """Greedy and sampled requests with logprobs=k (k = 0, 2, 5) and echo: each generated token's logprob and its k
  most likely alternatives, and each prompt token's (entry 0 None), equal the float64 log-softmax of one uncached
  forward pass over prompt + output (float32 against float64: atol 2e-5, a few float32 roundings of values ~5);
  with chunked prefill (chunks of 8) the prompt's logprobs come from 3 chunks."""
  cfg = config(*DECODE, f"use_chunked_prefill={chunked}", "prefill_chunk_size=8")
  model, params = _params(cfg)
  prompts = _prompts(cfg, [21, 6, 13], seed=7)
  requests = [
    engine_lib.Request(prompts[0], 8, logprobs=5, echo=True),
    engine_lib.Request(prompts[1], 10, temperature=1.0, seed=1, logprobs=2, echo=True),
    engine_lib.Request(prompts[2], 6, temperature=1.0, seed=2, logprobs=0),
  ]
  results = _engine(cfg, params).generate(requests)
  for request, result in zip(requests, results, strict=True):
    lp = _log_softmax(model, params, request.prompt + tuple(result.tokens))
    n, k = len(request.prompt), request.logprobs
    assert len(result.tokens) == request.max_tokens and len(result.logprobs) == request.max_tokens
    expected = [(i, t) for i, t in enumerate(result.tokens, start=n - 1)]  # position i's logits predict token t
    if request.echo:
      assert result.prompt_logprobs[0] is None and len(result.prompt_logprobs) == n
      expected = [(i, t) for i, t in enumerate(request.prompt[1:])] + expected
      got = result.prompt_logprobs[1:] + result.logprobs
    else:
      assert result.prompt_logprobs is None
      got = result.logprobs
    for (i, token), token_lp in zip(expected, got, strict=True):
      top = np.argsort(-lp[i], kind="stable")[:k]
      assert [t for t, _ in token_lp.top] == top.tolist(), i
      np.testing.assert_allclose(
        [token_lp.logprob, *(x for _, x in token_lp.top)], [lp[i, token], *lp[i, top]], atol=2e-5, rtol=0, err_msg=i
      )
  assert results[1].tokens != _full_forward(model, params, requests[1:2])[0]  # the sampled one is not greedy


# ------------------------------------------------------------------------------------------ stops
def _text(tokens):
  """A fake detokenizer: token t is "<t>", so a stop string can be made of any tokens."""
  return "".join(f"<{t}>" for t in tokens)


def _cut(g, stop):
  """(the text of tokens `g` before `stop`, the tokens up to the one that completes `stop`'s first occurrence)."""
  full = _text(g)
  assert stop in full
  end = next(m for m in range(len(g) + 1) if stop in _text(g[:m]))
  return full[: full.find(stop)], g[:end]


def test_stop_strings_ids_eos_and_length():
  """Against a prompt's greedy output g (16 tokens, from full recomputation): a stop string across tokens g[4] and
  g[5] cuts the text before it (finish "stop"; tokens up to the one completing it, none past it); stop_token_ids
  and EOS end before their first occurrence (the stop token left out); a stop on the first (prefill's) token gives
  nothing; max_tokens ends by "length"."""
  cfg = config(*DECODE, "per_device_batch_size=2", "decode_steps_per_dispatch=16")
  model, params = _params(cfg)
  prompt = _prompts(cfg, [7], seed=8)[0]
  g = _full_forward_greedy(model, params, prompt, 16)[0]
  stop = _text(g[4:6])[1:-1]  # "g4><g5"
  text, tokens = _cut(g, stop)
  assert len(tokens) < 16 and g[6] != g[0], g  # the cuts below are at different places
  cases = [
    (engine_lib.Request(prompt, 16, stop=("zzz", stop)), "stop", text, tokens),
    (engine_lib.Request(prompt, 16, stop_token_ids=(g[6],)), "stop", *_cut(g, f"<{g[6]}>")[:1], g[: g.index(g[6])]),
    (engine_lib.Request(prompt, 16, stop_token_ids=(g[0],)), "stop", "", []),
    (engine_lib.Request(prompt, 5), "length", _text(g[:5]), g[:5]),
    (engine_lib.Request(prompt, 16), "length", _text(g), g),
  ]
  engine = _engine(cfg, params, detokenize=_text)
  results = engine.generate([r for r, *_ in cases])
  for (request, finish, text, tokens), result in zip(cases, results, strict=True):
    assert (result.finish_reason, result.text) == (finish, text), request
    assert result.tokens[: len(tokens)] == tokens, request
    assert result.tokens == tokens or request.stop, request  # a stop string's tokens: the test below
    # The stop token that ended it is the result's stop_token (a stop string's cut and "length" have none).
    assert result.stop_token == (request.stop_token_ids[0] if request.stop_token_ids else None), request
  eos = _engine(cfg, params, detokenize=_text, end_ids=[g[3]]).generate([engine_lib.Request(prompt, 16, logprobs=0)])[0]
  first = g.index(g[3])
  assert (eos.tokens, eos.text, eos.finish_reason, eos.stop_token) == (g[:first], _text(g[:first]), "stop", g[3])
  assert len(eos.logprobs) == first and eos.stop_logprob is not None and eos.stop_logprob.logprob <= 0


def test_no_token_past_the_one_completing_a_stop_string():
  """16 steps per call: the result's tokens and logprobs end with the token that completes the stop string (the
  API's "after a stop, none past it"), though the compiled loop generated further tokens in the same call."""
  cfg = config(*DECODE, "per_device_batch_size=1", "decode_steps_per_dispatch=16")
  model, params = _params(cfg)
  prompt = _prompts(cfg, [7], seed=8)[0]
  g = _full_forward_greedy(model, params, prompt, 16)[0]
  text, tokens = _cut(g, _text(g[4:6])[1:-1])
  assert len(tokens) < 16
  (result,) = _engine(cfg, params, detokenize=_text).generate(
    [engine_lib.Request(prompt, 16, stop=(_text(g[4:6])[1:-1],), logprobs=0)]
  )
  assert (result.text, result.finish_reason) == (text, "stop")
  assert result.tokens == tokens and len(result.logprobs) == len(tokens)


def test_streamed_updates_add_up_and_stop_text_is_held_back():
  """Two steps per call, a stop string of two tokens: updates arrive in order, the first with the prefill's token
  alone; their tokens and texts add up to the greedy output cut at the stop string; only the last says "stop"."""
  cfg = config(*DECODE, "per_device_batch_size=1", "decode_steps_per_dispatch=2")
  model, params = _params(cfg)
  prompt = _prompts(cfg, [5], seed=9)[0]
  g = _full_forward_greedy(model, params, prompt, 12)[0]
  stop = _text(g[7:9])
  text, tokens = _cut(g, stop)
  assert len(tokens) > 4, g
  updates = []
  engine = _engine(cfg, params, detokenize=_text)
  engine.submit(engine_lib.Request(prompt, 12, stop=(stop,)), updates.append)
  while engine.busy():
    engine.run_once()
  assert len(updates) > 2 and [u.finish_reason for u in updates] == [None] * (len(updates) - 1) + ["stop"]
  assert len(updates[0].tokens) == 1
  assert "".join(u.text for u in updates) == text
  assert sum((u.tokens for u in updates), []) == tokens


# ------------------------------------------------------------------------------------------ threads and errors
def test_threaded_engine_cancels_serves_and_frees():
  """One slot. Cancelling the running request (from its first update) frees its slot, so the waiting one runs, and
  its pages; no final update reaches it. Then requests submitted from 4 threads all finish with their tokens alone.
  Every page comes back; stop() ends the thread."""
  cfg = config(*DECODE, "per_device_batch_size=1")
  _, params = _params(cfg)
  engine = _engine(cfg, params)
  start = engine.pages.available()
  requests = _requests(cfg, shapes=((4, 6), (9, 3), (2, 8), (11, 5)), seed=10)
  want = [r.tokens for r in _alone(DECODE, params, requests)]
  results = [engine_lib.Result() for _ in requests]
  done = [threading.Event() for _ in requests]

  def on_update(i, update):
    results[i].add(update)
    if update.finish_reason is not None:
      done[i].set()

  long_updates = []

  def cancel_on_first(update):
    long_updates.append(update)
    if len(long_updates) == 1:
      engine.cancel(long_id)

  # Both queued before the engine starts, so the long one takes the slot and the other waits.
  long_id = engine.submit(engine_lib.Request(requests[0].prompt, 30), cancel_on_first)
  engine.submit(requests[1], lambda u: on_update(1, u))
  engine.start()
  try:
    with deadline(60):
      done[1].wait()
    assert long_updates and all(u.finish_reason is None for u in long_updates)
    assert sum(len(u.tokens) for u in long_updates) < 30
    assert results[1].tokens == want[1] and results[1].finish_reason == "length"

    results[1], done[1] = engine_lib.Result(), threading.Event()
    threads = [
      threading.Thread(target=engine.submit, args=(r, lambda u, i=i: on_update(i, u))) for i, r in enumerate(requests)
    ]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    with deadline(60):
      for event in done:
        event.wait()
    assert [r.tokens for r in results] == want
    assert all(r.finish_reason == "length" for r in results)
    with deadline(60):
      while engine.busy():
        threading.Event().wait(0.01)
    assert engine.pages.available() == start and engine.pages.held() == 0
  finally:
    engine.stop()
  assert not engine.running()


def test_stop_aborts_running_requests_and_returns_their_pages():
  """stop() while a request generates: it ends with "abort", every page comes back, and the engine (no slot left
  active) then generates a request with the tokens of full recomputation."""
  cfg = config(*DECODE, "per_device_batch_size=2", "decode_steps_per_dispatch=1")
  model, params = _params(cfg)
  engine = _engine(cfg, params)
  start = engine.pages.available()
  request = _requests(cfg, shapes=((2, 38),), seed=12)[0]
  updates, running = [], threading.Event()

  def on_update(update):
    updates.append(update)
    running.set()

  engine.start()
  engine.submit(request, on_update)
  with deadline(60):
    running.wait()
  engine.stop()
  assert updates[-1].finish_reason == "abort" and sum(len(u.tokens) for u in updates) < 38
  assert engine.pages.available() == start and engine.pages.held() == 0
  (result,) = engine.generate([request])
  assert result.tokens == _full_forward(model, params, [request])[0]


def test_a_full_queue_and_bad_requests_are_refused_and_stop_aborts_the_waiting():
  """QueueFull past max_queue; RequestError naming the field for an empty prompt, too long a prompt and max_tokens
  beyond the cache (from submit and generate); stop() ends the queued requests with "abort"."""
  cfg = config(*DECODE, "per_device_batch_size=1")
  _, params = _params(cfg)
  engine = _engine(cfg, params, max_queue=2)
  bad = [
    (engine_lib.Request((), 4), "prompt"),
    (engine_lib.Request((1,) * 25, 4), "prompt"),
    (engine_lib.Request((1,) * 10, 31), "max_tokens=31"),
    (engine_lib.Request((1,) * 10, 0), "max_tokens=0"),
  ]
  for request, field in bad:
    with pytest.raises(engine_lib.RequestError, match=f"^{field}"):
      engine.submit(request, lambda u: None)
    with pytest.raises(engine_lib.RequestError, match=f"^{field}"):
      engine.generate([request])
  engine.submit(engine_lib.Request((1,) * 10, 30), lambda u: None)  # the longest that fits
  finishes = collections.Counter()
  engine.submit(engine_lib.Request((2, 3), 4), lambda u: finishes.update([u.finish_reason]))
  with pytest.raises(engine_lib.QueueFull):
    engine.submit(engine_lib.Request((4,), 4), lambda u: None)
  engine.stop()
  assert finishes == {"abort": 1} and not engine.busy()


# ------------------------------------------------------------------------------------------ pages
def test_pages_take_match_cache_release_and_evict_least_recently_used():
  """pages.Pages on its own: free pages in order, a cached page shared by reference count, available once no request
  holds it, and given out again (its digest forgotten) only when no free page is left, least recently used first."""
  pages = pages_lib.Pages(4, page_size=2)
  a = pages_lib.prefix_digests((1, 2, 3, 4, 5), 2)
  assert len(a) == 2 and a == pages_lib.prefix_digests((1, 2, 3, 4), 2)
  assert pages_lib.prefix_digests((9, 2, 3, 4), 2)[1] != a[1]  # a page's digest covers every token before it
  held = [pages.take(), pages.take()]
  assert held == [0, 1] and pages.available() == 2 and pages.held() == 2
  for page, digest in zip(held, a, strict=True):
    pages.cache(page, digest)
  assert pages.match(a) == held and pages.held() == 2  # shared: held twice
  pages.release(held)
  assert pages.available() == 2  # still held once
  pages.release(held)
  assert pages.available() == 4 and pages.held() == 0  # cached, unused, available
  assert pages.match(a[:1]) == [0]
  pages.release([0])  # page 0 is now the most recently used
  taken = [pages.take(), pages.take(), pages.take()]
  assert taken == [2, 3, 1]  # free pages first, then the least recently used cached one
  assert pages.match(a) == [0]  # page 1 was forgotten with its digest, so the match stops after page 0
  assert pages.available() == 0
  pages.release([0, *taken])
  assert pages.available() == 4


def test_a_rejected_request_queues_none_of_its_call():
  """generate() checks every request before it queues any: after a call refused for its second request, the next
  call runs only its own (its prefill counts its tokens alone)."""
  cfg = config(*DECODE, "per_device_batch_size=1")
  eng = _engine(cfg, _params(cfg)[1])
  good = engine_lib.Request((1, 2, 3), 4)
  with pytest.raises(engine_lib.RequestError, match="prompt"):
    eng.generate([good, engine_lib.Request((), 4)])
  eng.generate([good])
  assert eng.stats["prefill_tokens"] == 3


def test_after_warmup_no_request_compiles():
  """warmup() compiles every program the requests below need (prompts of every bucket, 1 to 3 busy slots, short
  and long contexts, chunked prefill's later chunks): running them compiles nothing more."""
  cfg = config(*DECODE, "use_chunked_prefill=true", "prefill_chunk_size=8")
  eng = _engine(cfg, _params(cfg)[1])
  eng.warmup()
  compiled = eng.stats["compile_seconds"]
  assert compiled > 0
  eng.generate(_requests(cfg))
  eng.generate(_requests(cfg, ((3, 2),)))
  assert eng.stats["compile_seconds"] == compiled


def test_prefill_widths_and_a_64_bit_seed_as_the_programs_take_them():
  """A chunk of n tokens is padded to a power of two from 16, at most the chunk's size (model_runner.bucket: few
  widths compile); a request's seed below 2**64 reaches the programs as its low and high 32 bits, with its other
  sampling settings (slots.sampling_of)."""
  assert [model_runner.bucket(n, 100) for n in (1, 16, 17, 33, 64, 65, 100)] == [16, 16, 32, 64, 64, 100, 100]
  row = slots_lib.sampling_of(engine_lib.Request((1,), 1, temperature=0.5, top_k=3, top_p=0.25), 2**40 + 5)
  assert row["seeds"].tolist() == [[5, 2**8]] and row["seeds"].dtype == np.uint32
  assert (row["temperature"].tolist(), row["top_k"].tolist(), row["top_p"].tolist()) == ([0.5], [3], [0.25])


def test_a_stop_string_cuts_where_it_completes_first_whatever_the_burst():
  """Stops ("bc ", "c") over tokens "bc", " ", "x": token by token, "c" completes first (with "bc"), so the text is
  "b" and the tokens end with "bc", whether the tokens arrive one call at a time or in one burst (a burst's length
  depends on the neighbours' early exits)."""
  pieces = {1: "bc", 2: " ", 3: "x", 5: "p"}

  def detokenize(tokens):
    return "".join(pieces[t] for t in tokens)

  for bursts in ([[1, 2, 3]], [[1], [2], [3]]):
    updates = []
    row = output_lib.RequestOutput(engine_lib.Request((5,), 8, stop=("bc ", "c")), updates.append, detokenize)
    for burst in bursts:
      row.tokens += burst
      text, cut = row.new_text(burst, final=False)
      row.send(text, "stop" if cut else None)
      if cut:
        break
    assert ("".join(u.text for u in updates), row.tokens, updates[-1].finish_reason) == ("b", [1], "stop"), bursts


# ------------------------------------------------------------------------------------------ text and streaming
def _sp_like(tokens):
  """A detokenizer that, like SentencePiece, drops the space of a text's first word: even ids are words ("▁w4",
  a space and w4), odd ones pieces of words ("p5")."""
  return "".join(f"▁w{t}" if t % 2 == 0 else f"p{t}" for t in tokens).replace("▁", " ").removeprefix(" ")


def test_text_is_decoded_after_the_prompt():
  """Each result's text (its updates' texts joined) is what its tokens add after its prompt's, decode(prompt +
  tokens) past decode(prompt): a first word keeps its space (before: the tokens were decoded alone, and lost it)."""
  cfg = config(*DECODE)
  _, params = _params(cfg)
  requests = _requests(cfg)
  results = _engine(cfg, params, detokenize=_sp_like).generate(requests)
  for request, result in zip(requests, results, strict=True):
    prompt = _sp_like(request.prompt)
    assert prompt + result.text == _sp_like(request.prompt + tuple(result.tokens)), request
  assert any(result.text.startswith(" ") for result in results)


def test_a_streamed_request_gets_its_tokens_as_they_are_made():
  """decode_steps_per_dispatch=16. A request with stream=True gets one update per token when one step fills
  stream_interval_ms (every update after the prefill's holds one token), and bursts when 16 steps fit; without
  stream, bursts of up to 16. The tokens are full recomputation's greedy ones in every case."""
  cfg = config(*DECODE, "per_device_batch_size=1", "decode_steps_per_dispatch=16")
  model, params = _params(cfg)
  request = _requests(cfg, shapes=((6, 14),), seed=4)[0]
  want = _full_forward(model, params, [request])[0]

  def updates(stream: bool, interval_ms: float) -> list[int]:
    engine = _engine(cfg, params, stream_interval_ms=interval_ms)
    sizes = []
    engine.submit(dataclasses.replace(request, stream=stream), lambda u: sizes.append(len(u.tokens)))
    while engine.busy():
      engine.run_once()
    return sizes

  assert updates(True, 1e-6) == [1] * 14  # one step fits: every token as it is made
  assert updates(False, 1e-6)[1:] == [13]  # no stream: the whole rest in one call
  bursts = updates(True, 1e6)  # 16 steps fit: the first call is timed with one step, then the rest at once
  assert bursts == [1, 1, 12], bursts
  (result,) = _engine(cfg, params, stream_interval_ms=1e-6).generate([dataclasses.replace(request, stream=True)])
  assert result.tokens == want


# ------------------------------------------------------------------------------------------ batch invariance
def _invariance_case(dtype: str, invariant: bool):
  """A request with logprobs alone in a 4-slot engine, then fifth of five requests there (it waits for a slot and
  joins three neighbours mid-generation: of other lengths, one sampled, two with logprobs, one without), at
  default matmul precision in `dtype`: (its two results, the engine)."""
  cfg = config(*DECODE, "per_device_batch_size=4", f"dtype={dtype}", "matmul_precision=default",
               f"decode_batch_invariant={str(invariant).lower()}")  # fmt: skip
  _, params = _params(cfg)
  engine = _engine(cfg, params)
  request = engine_lib.Request(_prompts(cfg, [9], seed=5)[0], 20, logprobs=2)
  alone = engine.generate([request])[0]
  others = _requests(cfg, shapes=((3, 4), (17, 12), (6, 20), (22, 9)), seed=6)
  others[1] = dataclasses.replace(others[1], temperature=1.0, seed=3, logprobs=5)
  others[2] = dataclasses.replace(others[2], logprobs=1)
  crowded = engine.generate([*others, request])[-1]
  return alone, crowded, engine


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_invariant_decoding_gives_a_request_the_same_bits_whatever_its_neighbours(dtype):
  """decode_batch_invariant: a request's tokens and each token's logprob, bit for bit, are the same alone in the
  engine and beside neighbours that change how many rows are busy and how far the longest reaches. Without it the
  generate call runs a power of two of the busy rows and reads the pages the longest neighbour reaches, and on this
  CPU a float32 row's logits then change in their last bits with the number of rows (the reason for the key)."""
  alone, crowded, engine = _invariance_case(dtype, invariant=True)
  assert crowded.tokens == alone.tokens and len(alone.tokens) == 20
  assert [lp.logprob for lp in crowded.logprobs] == [lp.logprob for lp in alone.logprobs]
  assert [lp.top for lp in crowded.logprobs] == [lp.top for lp in alone.logprobs]
  assert {p.shape for p in engine.programs() if p.name == "generate"} == {(4, engine.pages_per_row)}


def test_batch_invariance_refuses_the_prefix_cache():
  with pytest.raises(engine_lib.ConfigError, match="decode_batch_invariant=true with enable_prefix_caching=true"):
    config(*DECODE, "decode_batch_invariant=true", "enable_prefix_caching=true")  # refused when the config is read
