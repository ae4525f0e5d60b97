"""Hugging Face checkpoints of every family against transformers itself, on small random models (float32, CPU).

Each example of each family (its module's hf_examples, found through the registry): a random transformers model is
saved, imported with convert_hf_checkpoint.py, and our logits on a padded batch match transformers' (max |difference|
<= 1e-4 x max |logit|); greedy decoding matches `generate(do_sample=False)` token for token; exporting gives back the
original safetensors bit for bit, and the exported folder loads in transformers with the same logits.
"""

import json
import os

import jax
import numpy as np
import pytest

from MaxText import chat_template as template_lib
from MaxText import checkpointing, convert_hf_checkpoint, convert_to_hf_checkpoint, families, sharding
from MaxText import state as state_lib
from MaxText.inference import engine as engine_lib
from MaxText.layers import models
from MaxText.tests.helpers import BASE_YML, config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}

# Every family's small random transformers models (its module's hf_examples), by example name.
EXAMPLES = {name: (family, ex) for family in families.FAMILIES.values() for name, ex in family.hf_examples.items()}


def test_every_family_with_a_hugging_face_mapping_has_its_examples():
  """A family that converts to and from Hugging Face's format is tested against transformers: it gives at least one
  example, and example names are unique across families (save_random finds one by its name alone)."""
  named = [name for family in families.FAMILIES.values() for name in family.hf_examples]
  assert len(named) == len(set(named))
  assert all(family.hf_examples for family in families.FAMILIES.values() if family.hf is not None)


def hf_model(name: str, **changes):
  """The random transformers model of example `name` (a family's hf_examples): its model_type's config class with
  the example's keys (and `changes`), and that model type's causal LM."""
  family, example = EXAMPLES[name]
  cfg = transformers.AutoConfig.for_model(family.hf.model_type, **(dict(example.config) | changes))
  return transformers.AutoModelForCausalLM.from_config(cfg)


def save_random(name: str, folder: str, max_shard_size: str | None = None, **changes):
  """Example `name`'s model (with config `changes`) with random weights, saved to `folder` in transformers' format."""
  torch.manual_seed(0)
  model = hf_model(name, **changes).eval()
  with torch.no_grad():
    for p in model.parameters():  # norms and biases random too, so every tensor's mapping is tested
      p.normal_(0.0, 0.3)
    for buffer_name, b in model.named_buffers():  # DeepSeek's routing bias is a buffer
      if buffer_name.endswith("e_score_correction_bias"):
        b.normal_(0.0, 0.3)
  model.save_pretrained(folder, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
  model.generation_config.eos_token_id = None
  model.generation_config.pad_token_id = 0
  return model


def import_hf(folder: str, out: str, scan: str = "true") -> str:
  argv = [
    "convert",
    BASE_YML,
    f"hf_model_path={folder}",
    f"base_output_directory={out}",
    "run_name=imported",
    "jax_cache_dir=",
  ]
  assert convert_hf_checkpoint.main([*argv, f"scan_layers={scan}"]) == 0
  return os.path.join(out, "imported", "checkpoints", "0")


def our_config(ckpt: str, *extra, scan="true"):
  return config(
    f"model_name={os.path.join(ckpt, 'model.yml')}",
    f"load_parameters_path={os.path.join(ckpt, 'items')}",
    f"scan_layers={scan}",
    "max_target_length=32",
    "max_prefill_predict_length=16",
    "per_device_batch_size=2",
    *extra,
  )


def restore(cfg):
  mesh = sharding.create_mesh(cfg, jax.devices()[:1])
  abstract, _ = state_lib.params_layout(models.Transformer(cfg, mesh), cfg, mesh)
  return mesh, checkpointing.restore_params(cfg, abstract)[0]


def padded_batch(lengths, vocab, width=24, seed=1):
  rng = np.random.default_rng(seed)
  tokens = np.zeros((len(lengths), width), np.int32)
  for row, n in enumerate(lengths):
    tokens[row, :n] = rng.integers(1, vocab, n)
  valid = (np.arange(width)[None] < np.asarray(lengths)[:, None]).astype(np.int32)
  return tokens, valid


def our_logits(cfg, mesh, params, tokens, valid):
  model = models.Transformer(cfg, mesh)
  positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
  return np.asarray(jax.jit(model.apply)({"params": params}, tokens, valid, positions))


def hf_logits(model, tokens, valid):
  with torch.no_grad():
    out = model(input_ids=torch.from_numpy(tokens).long(), attention_mask=torch.from_numpy(valid).long())
  return out.logits.float().numpy()


def assert_close(ours, theirs, valid):
  """max |ours - theirs| over real tokens <= 1e-4 x max |theirs|."""
  mask = valid.astype(bool)
  err = np.max(np.abs(ours[mask] - theirs[mask])) / np.max(np.abs(theirs[mask]))
  assert err <= 1e-4, f"relative logit difference {err:.2e}"


# Each family's first example runs in the quick loop; its further variants (another RoPE, layout) are slow-marked.
FIRST_EXAMPLES = {next(iter(family.hf_examples)) for family in families.FAMILIES.values() if family.hf_examples}


@pytest.mark.parametrize(
  "name", [pytest.param(n, marks=[] if n in FIRST_EXAMPLES else [pytest.mark.slow]) for n in sorted(EXAMPLES)]
)
def test_import_matches_transformers_and_export_round_trips(name, tmp_path):
  example = EXAMPLES[name][1]
  scan = "true" if example.scan_layers else "false"  # the examples between them cover both layouts
  hf_dir = str(tmp_path / "hf")
  model = save_random(name, hf_dir, max_shard_size=example.max_shard_size)
  ckpt = import_hf(hf_dir, str(tmp_path / "out"), scan)

  cfg = our_config(ckpt, scan=scan)
  mesh, params = restore(cfg)
  tokens, valid = padded_batch([24, 13, 7], cfg.vocab_size)
  theirs = hf_logits(model, tokens, valid)
  assert_close(our_logits(cfg, mesh, params, tokens, valid), theirs, valid)

  # Greedy decoding (the engine: paged KV cache, compiled loop) against transformers' generate, per prompt.
  engine = engine_lib.Engine(cfg, mesh, params)
  prompts = [tokens[1, :13], tokens[2, :7]]
  n = cfg.max_target_length - cfg.max_prefill_predict_length
  ours = engine.generate([engine_lib.Request(tuple(int(t) for t in p), n) for p in prompts])
  for prompt, got in zip(prompts, ours, strict=True):
    with torch.no_grad():
      want = model.generate(torch.from_numpy(prompt[None]).long(), do_sample=False, max_new_tokens=n, min_new_tokens=n)
    np.testing.assert_array_equal(got.tokens, want[0, len(prompt) :].numpy())

  # Export: the original tensors bit for bit, and transformers loads the folder with the same logits.
  out = str(tmp_path / "exported")
  argv = ["export", BASE_YML, *_keys(cfg), f"hf_model_path={out}", "hf_max_shard_size_mb=1"]
  assert convert_to_hf_checkpoint.main(argv) == 0
  assert_same_tensors(hf_dir, out)
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  np.testing.assert_array_equal(hf_logits(reloaded, tokens, valid)[valid.astype(bool)], theirs[valid.astype(bool)])


def _keys(cfg):
  return [f"{k}={getattr(cfg, k)}" for k in ("model_name", "load_parameters_path", "scan_layers")] + [
    "run_name=export",
    "jax_cache_dir=",
  ]


def read_safetensors(folder):
  from safetensors.numpy import load_file

  out = {}
  for name in sorted(os.listdir(folder)):
    if name.endswith(".safetensors"):
      out.update(load_file(os.path.join(folder, name)))
  return out


def assert_same_tensors(original, exported):
  a, b = read_safetensors(original), read_safetensors(exported)
  assert sorted(a) == sorted(b)
  for name in a:
    assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
    assert a[name].tobytes() == b[name].tobytes(), name


def test_bfloat16_round_trip_is_bit_exact(tmp_path):
  """A bfloat16 checkpoint imported with weight_dtype=bfloat16 exports to the same bytes; into float32 (exact)
  it gives the same logits."""
  hf_dir = str(tmp_path / "hf")
  model = save_random("gemma2", hf_dir)
  model.to(torch.bfloat16).save_pretrained(hf_dir)
  out = str(tmp_path / "out")
  argv = ["convert", BASE_YML, f"hf_model_path={hf_dir}", f"base_output_directory={out}", "run_name=bf16", "jax_cache_dir="]
  assert convert_hf_checkpoint.main([*argv, "weight_dtype=bfloat16"]) == 0
  ckpt = os.path.join(out, "bf16", "checkpoints", "0")
  cfg = our_config(ckpt, "weight_dtype=bfloat16")
  exported = str(tmp_path / "exported")
  assert convert_to_hf_checkpoint.main(["export", BASE_YML, *_keys(cfg), f"hf_model_path={exported}"]) == 0
  assert_same_tensors(hf_dir, exported)
  assert json.load(open(os.path.join(exported, "config.json")))["torch_dtype"] == "bfloat16"


def test_config_json_of_transformers_4_and_5_give_the_same_keys():
  """rope_theta + rope_scaling (4.x) and rope_parameters (5.x) read alike; layer_types must fit the family."""
  from MaxText.common_types import ConfigError

  base = dict(model_type="llama", hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=96)
  base |= dict(vocab_size=100, hidden_act="silu")
  rope = LLAMA3_ROPE | {"original_max_position_embeddings": 8192}
  v4 = families.model_keys_from_hf(base | {"rope_theta": 500000.0, "rope_scaling": rope})
  v5 = families.model_keys_from_hf(base | {"rope_parameters": rope | {"rope_theta": 500000.0}})
  assert v4 == v5 and v4["rope_type"] == "llama3.1" and v4["rope_max_timescale"] == 500000.0
  with pytest.raises(ConfigError, match="rope type 'dynamic'"):
    families.model_keys_from_hf(base | {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
  deepseek_yarn = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale_all_dim": 1.0}
  with pytest.raises(ConfigError, match="mscale_all_dim is not supported"):
    families.model_keys_from_hf(base | {"rope_scaling": deepseek_yarn})
  gemma2 = dict(base, model_type="gemma2", hidden_activation="gelu_pytorch_tanh", head_dim=16)
  with pytest.raises(ConfigError, match="layer_types"):
    families.model_keys_from_hf(gemma2 | {"layer_types": ["full_attention", "sliding_attention"]})


def test_imported_params_keep_their_values(tmp_path):
  """The stored params are exactly the transformers tensors, rearranged (query of layer 1, the embedding)."""
  hf_dir = str(tmp_path / "hf")
  model = save_random("llama", hf_dir)
  ckpt = import_hf(hf_dir, str(tmp_path / "out"))
  _, params = restore(our_config(ckpt))
  sd = {k: v.numpy() for k, v in model.state_dict().items()}
  q = sd["model.layers.1.self_attn.q_proj.weight"]  # [heads * head_dim, embed]
  np.testing.assert_array_equal(np.asarray(params["layers"]["self_attention"]["query"]["kernel"][1]), q.T.reshape(48, 6, 8))
  np.testing.assert_array_equal(np.asarray(params["token_embedder"]["embedding"]), sd["model.embed_tokens.weight"])


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_a_quantized_config_json_is_refused_unless_the_family_dequantizes_it(name):
  """Every family's config.json with a quantization_config its importer cannot dequantize (bitsandbytes 4-bit here;
  Llama 4 Maverick's FP8 release, DeepSeek-V3's fp8) is refused in one line naming it; the methods a family lists
  (gpt-oss's mxfp4) are read."""
  from MaxText.common_types import ConfigError

  family, example = EXAMPLES[name]
  hf = transformers.AutoConfig.for_model(family.hf.model_type, **example.config).to_dict()
  hf.pop("quantization_config", None)
  families.model_keys_from_hf(hf)
  with pytest.raises(
    ConfigError, match=rf"quantization_config \(bitsandbytes\) is not supported for {family.hf.model_type}"
  ):
    families.model_keys_from_hf(hf | {"quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}})
  for method in family.hf.quantizations:
    assert families.model_keys_from_hf(
      hf | {"quantization_config": {"quant_method": method}}
    ) == families.model_keys_from_hf(hf)


# ------------------------------------------------------------------------------------------ tokenizers
# Qwen's shape of ChatML: a default system turn, each turn closed by <|im_end|>, the generation prompt.
CHATML = (
  "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
  "{% endif %}"
  "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
  "{% endfor %}"
  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHAT_VOCAB = 320  # the byte-level BPE's 256 bytes, ChatML's 3 special tokens and merges
CONVERSATIONS = [
  [{"role": "user", "content": "Which book is this verse from? In the beginning God created"}],
  [
    {"role": "system", "content": "Answer in one word."},
    {"role": "user", "content": "Who speaks this line? To be, or not to be"},
    {"role": "assistant", "content": "Hamlet"},
    {"role": "user", "content": "And this one? 日本語 🙂"},
  ],
]


def save_chat_tokenizer(folder: str, eos_token: str = "<|im_end|>"):
  """A byte-level BPE tokenizer of CHAT_VOCAB tokens with ChatML's special tokens and CHATML as its chat template,
  saved by transformers (tokenizer.json, tokenizer_config.json, chat_template.jinja: transformers 5's files)."""
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, trainers

  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  words = " ".join(m["content"] for c in CONVERSATIONS for m in c) + " system user assistant helpful"
  trainer = trainers.BpeTrainer(
    vocab_size=CHAT_VOCAB,
    special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
  )
  tok.train_from_iterator([words] * 20, trainer)
  hf = transformers.PreTrainedTokenizerFast(
    tokenizer_object=tok, bos_token="<|endoftext|>", eos_token=eos_token, pad_token="<|endoftext|>"
  )
  hf.chat_template = CHATML
  hf.save_pretrained(folder)
  return hf


@pytest.fixture(scope="module")
def chat_import(tmp_path_factory):
  """(a random Qwen 2 folder with the chat tokenizer, as transformers saves both; its import's checkpoint folder,
  the import's stdout)."""
  import contextlib
  import io

  root = tmp_path_factory.mktemp("chat")
  hf_dir = str(root / "hf")
  save_random("qwen2", hf_dir, vocab_size=CHAT_VOCAB)
  save_chat_tokenizer(hf_dir)
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    ckpt = import_hf(hf_dir, str(root / "out"))
  return hf_dir, ckpt, printed.getvalue()


def test_the_import_copies_the_chat_template_and_runs_render_with_it(chat_import, capsys):
  """transformers 5 keeps the chat template in chat_template.jinja: the import copies it (and generation_config.json)
  beside tokenizer.json, so the template a run finds there is the model's own, not the fallback, and says so; a
  conversation rendered by a run's path (decode.py's and serve.py's prompts.chat_tokens) is transformers'
  apply_chat_template on the source folder, token for token."""
  from MaxText.inference import prompts
  from MaxText.input_pipeline import tokenizer as tokenizer_lib

  hf_dir, ckpt, printed = chat_import
  for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
    with open(os.path.join(hf_dir, name), "rb") as a, open(os.path.join(ckpt, name), "rb") as b:
      assert a.read() == b.read(), name
  assert f"tokenizer_type=huggingface tokenizer_path={ckpt}/tokenizer.json" in printed
  capsys.readouterr()
  template, where = template_lib.find_template("", "", os.path.join(ckpt, "tokenizer.json"))
  assert template == CHATML and where == os.path.join(ckpt, "chat_template.jinja")
  assert capsys.readouterr().out == f"chat template: {where} (the tokenizer's)\n"

  reference = transformers.AutoTokenizer.from_pretrained(hf_dir)
  cfg = our_config(ckpt, "tokenizer_type=huggingface", f"tokenizer_path={ckpt}/tokenizer.json", "use_chat_template=true")
  ours = tokenizer_lib.load(cfg.tokenizer_path, "huggingface")
  for turns in CONVERSATIONS:
    want = reference.apply_chat_template(turns, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert prompts.chat_tokens(cfg, ours, turns) == list(want)
    assert prompts.chat_tokens(cfg, ours, turns) != template_lib.render(
      template_lib.compile_template(template_lib.FALLBACK_TEMPLATE), ours, turns, True
    )


def test_the_export_writes_the_tokenizer_and_generate_stops_at_its_eos(chat_import, tmp_path):
  """Exported with the keys the import printed: config.json has the tokenizer's BOS and EOS ids and the source's
  max_position_embeddings (128, not 8192), the folder the tokenizer's files with the chat template; transformers
  loads both, renders chat as the source does, and generate() with no stopping arguments stops at the EOS. (The EOS
  here is a token the random model's greedy continuation reaches: its 4th.)"""
  from tokenizers import Tokenizer

  hf_dir, ckpt, _ = chat_import
  source = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
  prompt = torch.tensor([[5, 40, 77, 120, 9]])
  with torch.no_grad():
    free = source.generate(prompt, do_sample=False, max_new_tokens=12, eos_token_id=None, pad_token_id=0)[0, 5:]
  k = next(i for i in range(3, 12) if int(free[i]) not in free[:i].tolist())  # (a random model's 12 differ)
  eos = Tokenizer.from_file(os.path.join(ckpt, "tokenizer.json")).id_to_token(int(free[k]))
  tok_dir = tmp_path / "tokenizer"
  save_chat_tokenizer(str(tok_dir), eos_token=eos)

  out = str(tmp_path / "exported")
  keys = [f"model_name={ckpt}/model.yml", f"load_parameters_path={ckpt}/items", "run_name=export", "jax_cache_dir="]
  argv = ["export", BASE_YML, *keys, f"hf_model_path={out}", "tokenizer_type=huggingface"]
  assert convert_to_hf_checkpoint.main([*argv, f"tokenizer_path={tok_dir}/tokenizer.json"]) == 0
  written = json.load(open(os.path.join(out, "config.json")))
  assert written["max_position_embeddings"] == 128
  assert written["bos_token_id"] == 0 and written["eos_token_id"] == int(free[k])
  for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    assert os.path.isfile(os.path.join(out, name)), name

  tokenizer = transformers.AutoTokenizer.from_pretrained(out)
  assert tokenizer.eos_token == eos and tokenizer.chat_template == CHATML
  model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  with torch.no_grad():
    stopped = model.generate(prompt, do_sample=False, max_new_tokens=12, pad_token_id=0)[0, 5:]
  assert stopped.tolist() == free[: k + 1].tolist()


def test_a_chat_served_on_the_import_answers_as_transformers_greedy_generate(tmp_path):
  """serve.py's chat route on an imported Llama (SmolLM2's architecture) with its own chat template and end tokens,
  as the import copied them, answers each conversation as transformers' greedy generate() does on the source
  folder: the same tokens (the answer's text and count), stopping at the same token. generation_config.json lists
  the end ids, as Llama 3's does: <|im_end|> and a token greedy decoding reaches in the first answer (a random model
  never says <|im_end|>), so that answer stops early; the run says which ids end a completion and where from. (The
  weights are random with norms near 1, so the answers depend on the prompt, unlike those of save_random's.)"""
  import contextlib
  import io
  import shutil

  from MaxText.server import app as server_app
  from MaxText.server import options as server_options
  from MaxText.tests.serve_test import client, running

  hf_dir = str(tmp_path / "hf")
  torch.manual_seed(0)
  model = hf_model("llama", vocab_size=CHAT_VOCAB).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(1 + 0.1 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.2)
  model.save_pretrained(hf_dir)
  save_chat_tokenizer(hf_dir)
  ckpt = import_hf(hf_dir, str(tmp_path / "out"))
  reference = transformers.AutoTokenizer.from_pretrained(hf_dir)
  prompts = [reference.apply_chat_template(c, add_generation_prompt=True, return_tensors="pt") for c in CONVERSATIONS]
  prompts = [p["input_ids"] if not isinstance(p, torch.Tensor) else p for p in prompts]
  with torch.no_grad():
    free = model.generate(prompts[0], do_sample=False, max_new_tokens=10, eos_token_id=None, pad_token_id=0)[0]
  free = free[prompts[0].shape[1] :].tolist()
  k = next(i for i in range(3, 10) if free[i] not in free[:i])
  im_end = reference.convert_tokens_to_ids("<|im_end|>")
  folder = tmp_path / "tokenizer"
  folder.mkdir()
  for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    shutil.copy(os.path.join(ckpt, name), folder / name)
  (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [im_end, free[k]], "pad_token_id": 0}))
  generation = transformers.GenerationConfig.from_pretrained(str(folder))
  want = []
  for prompt in prompts:
    with torch.no_grad():
      out = model.generate(prompt, generation_config=generation, do_sample=False, max_new_tokens=10)[0]
    want.append(out[prompt.shape[1] :].tolist())
  assert len(want[0]) == k + 1 and want[0][-1] == free[k]  # the first answer stops at the listed end id

  cfg = our_config(
    ckpt, "tokenizer_type=huggingface", f"tokenizer_path={folder}/tokenizer.json", "use_chat_template=true",
    "dtype=float32", "max_target_length=96", "max_prefill_predict_length=80", "per_device_batch_size=2",
  )  # fmt: skip
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):  # (not capsys: uvicorn's log handlers would keep its stream past the test)
    engine, tokenizer = engine_lib.Engine.from_config(cfg)
  said = printed.getvalue()
  assert f"decoding stops at <|im_end|> ({im_end}), tokenizer_config.json's eos_token and generation_config.json's" in said
  assert f"; {reference.convert_ids_to_tokens(free[k])} ({free[k]}), generation_config.json's eos_token_id" in said
  options = server_options.Options.from_config(cfg)
  engine.start()
  try:
    with running(server_app.create_app(engine, tokenizer, options)) as url:
      for turns, tokens in zip(CONVERSATIONS, want, strict=True):
        chat = client(url).chat.completions.create(model=options.model_name, messages=turns, max_tokens=10, temperature=0)
        ended = tokens[-1] in generation.eos_token_id
        answer = tokens[:-1] if ended else tokens  # (the end token is not part of the answer's text)
        assert chat.choices[0].message.content == reference.decode(answer, skip_special_tokens=True)
        assert chat.choices[0].finish_reason == ("stop" if ended else "length")
        assert chat.usage.completion_tokens == len(answer)
  finally:
    engine.stop()


def test_the_export_writes_a_sentencepiece_tokenizer_that_transformers_splits_as_ours(tmp_path):
  """A model made here with a SentencePiece tokenizer (the quick start's kind) exports with a tokenizer.json that
  transformers reads into the same tokens as our runs (BOS first, as add_bos puts it), the same text back, BOS and
  EOS in config.json, and max_position_embeddings the length it was trained at (max_target_length), not 8192."""
  import sentencepiece as spm

  from MaxText import train_tokenizer
  from MaxText.input_pipeline import tokenizer as tokenizer_lib

  texts = [f"The {w} of the sea is {n}. Which book? Genesis Hamlet" for n in range(50) for w in ("sun", "moon")]
  model_file = str(tmp_path / "spm.model")
  train_tokenizer.train(texts, vocab_size=296, output=model_file)
  hf_dir = str(tmp_path / "hf")
  save_random("mistral", hf_dir, vocab_size=300)  # default RoPE (a scaled one serves its scaled length)
  # Made here: imported, then its model.yml without the source's length, as a model trained here has none.
  ckpt = import_hf(hf_dir, str(tmp_path / "out"))
  yml = os.path.join(ckpt, "model.yml")
  lines = open(yml).read().splitlines()
  open(yml, "w").write("\n".join(line for line in lines if not line.startswith("hf_max_position_embeddings")))
  out = str(tmp_path / "exported")
  keys = [f"model_name={yml}", f"load_parameters_path={ckpt}/items", "run_name=export", "jax_cache_dir="]
  keys += [f"tokenizer_path={model_file}", "max_target_length=48", f"hf_model_path={out}", "use_chat_template=true"]
  assert convert_to_hf_checkpoint.main(["export", BASE_YML, *keys]) == 0
  written = json.load(open(os.path.join(out, "config.json")))
  sp = spm.SentencePieceProcessor(model_file=model_file)
  assert written["max_position_embeddings"] == 48
  assert (written["bos_token_id"], written["eos_token_id"]) == (sp.bos_id(), sp.eos_id()) == (2, 1)
  tokenizer = transformers.AutoTokenizer.from_pretrained(out)
  for text in ["The sun of the sea is 7.", "  Which   book?\nGenesis", "unseen words: Ophelia 日本 🙂", ""]:
    assert tokenizer(text).input_ids == [sp.bos_id(), *sp.encode(text)], text
    assert tokenizer.decode(tokenizer(text).input_ids, skip_special_tokens=True) == sp.decode(sp.encode(text)), text
  # Tuned with use_chat_template on a tokenizer without a template of its own: the fallback, which transformers then
  # renders as our runs do.
  assert tokenizer.chat_template == template_lib.FALLBACK_TEMPLATE
  ours = tokenizer_lib.load(model_file, "sentencepiece")
  for turns in CONVERSATIONS:
    want = tokenizer.apply_chat_template(turns, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert template_lib.render(template_lib.compile_template(template_lib.FALLBACK_TEMPLATE), ours, turns, True) == list(
      want
    )
