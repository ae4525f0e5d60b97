"""Supervised fine-tuning data: chat templates against transformers, the completion mask, packing, and the CLI."""

import json
import os
import re

import numpy as np
import pytest

from MaxText import chat_template as template_lib
from MaxText import train_tokenizer
from MaxText.common_types import ConfigError
from MaxText.input_pipeline import sft, text_pipeline
from MaxText.input_pipeline import tokenizer as tokenizer_lib
from MaxText.objectives import losses as losses_lib
from MaxText.objectives import sft as sft_objective
from MaxText.tests.helpers import BASE_YML, config, deadline, run
from MaxText.tests.helpers import overrides as overrides_of

CHATML = (
  "{% for message in messages %}"
  "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
  "{% endfor %}"
  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Llama 3's shape: BOS from the tokenizer, a namespace, loop controls, whitespace trimmed by the environment.
HEADERS = """{{ bos_token }}
{% set ns = namespace(system='') %}
{% for message in messages %}
  {% if message['role'] == 'system' %}
    {% set ns.system = message['content'] %}
    {% continue %}
  {% endif %}
  {% if loop.index0 == 1 and ns.system %}{{ '<|im_start|>system\n' + ns.system | trim + '<|im_end|>' }}{% endif %}
  {{ '<|im_start|>' + message['role'] + '\n' + message['content'] | trim + '<|im_end|>' }}
{% endfor %}
{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"""
# ChatML with the assistant's part marked for transformers' return_assistant_tokens_mask, and a role check.
MARKED = (
  "{% for message in messages %}"
  "{% if message['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}"
  "{{ '<|im_start|>' + message['role'] + '\n' }}"
  "{% if message['role'] == 'assistant' %}"
  "{% generation %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endgeneration %}"
  "{% else %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endif %}"
  "{% endfor %}"
  "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

CONVERSATIONS = [
  [
    {"role": "user", "content": "Which book is this verse from? In the beginning God created"},
    {"role": "assistant", "content": "Genesis"},
  ],
  [
    {"role": "system", "content": "You are a helpful assistant. "},
    {"role": "user", "content": "Who speaks this line? To be, or not to be"},
    {"role": "assistant", "content": "Hamlet"},
    {"role": "user", "content": "And this one? 日本語 🙂 <|im_end|> inside"},
    {"role": "assistant", "content": " Ophelia\n"},
  ],
  [{"role": "user", "content": ""}, {"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}],
]  # fmt: skip
WORDS = " ".join(m["content"] for c in CONVERSATIONS for m in c) + " helpful assistant user system"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  """A byte-level BPE tokenizer.json with ChatML's special tokens (+ tokenizer_config.json), and a SentencePiece
  model."""
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, trainers

  root = tmp_path_factory.mktemp("sft")
  hf = tokenizers.Tokenizer(models.BPE())
  hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  hf.decoder = decoders.ByteLevel()
  specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"]
  trainer = trainers.BpeTrainer(
    vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
  )
  hf.train_from_iterator([WORDS] * 20, trainer)
  os.makedirs(root / "hf")
  hf.save(str(root / "hf/tokenizer.json"))
  settings = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "<|im_end|>"}
  (root / "hf/tokenizer_config.json").write_text(
    json.dumps({**settings, "pad_token": "<|endoftext|>", "chat_template": CHATML})
  )
  texts = [f"The {w} of the sea is {n}. Which book? Genesis Hamlet" for n in range(50) for w in ("sun", "moon")]
  train_tokenizer.train(texts, vocab_size=296, output=str(root / "spm.model"))
  return root


def _conversation(files, template, tokenizer="hf", columns=("messages",), completion_only=True, add_bos=True, add_eos=True):
  path, kind = (files / "hf/tokenizer.json", "huggingface") if tokenizer == "hf" else (files / "spm.model", "sentencepiece")
  return sft.Conversation(str(path), kind, columns, "train_data_columns", template, completion_only, add_bos, add_eos)


def _reference(files, template):
  import transformers

  tok = transformers.AutoTokenizer.from_pretrained(str(files / "hf"))
  tok.chat_template = template
  return tok


@pytest.mark.parametrize("template", [CHATML, HEADERS, MARKED], ids=["chatml", "headers", "marked"])
def test_chat_template_renders_as_transformers_token_for_token(files, template):
  reference = _reference(files, template)
  conversation = _conversation(files, template)
  tokenizer = tokenizer_lib.load(str(files / "hf/tokenizer.json"), "huggingface")
  compiled = template_lib.compile_template(template)
  for turns in CONVERSATIONS:
    for generation_prompt in (False, True):
      want = reference.apply_chat_template(turns, tokenize=True, add_generation_prompt=generation_prompt)["input_ids"]
      assert template_lib.render(compiled, tokenizer, turns, generation_prompt) == list(want)
    want = reference.apply_chat_template(turns)["input_ids"]
    np.testing.assert_array_equal(conversation({"messages": turns})["tokens"], want)


def test_completion_mask_is_transformers_assistant_mask(files):
  """The mask found from the template's generation prompt equals the one transformers reads off {% generation %}."""
  reference = _reference(files, MARKED)
  conversation = _conversation(files, MARKED)
  for turns in CONVERSATIONS:
    want = reference.apply_chat_template(turns, return_dict=True, return_assistant_tokens_mask=True)
    got = conversation({"messages": turns})
    np.testing.assert_array_equal(got["tokens"], want["input_ids"])
    np.testing.assert_array_equal(got["mask"], want["assistant_masks"])
    assert got["mask"].sum() > 0
  everything = _conversation(files, MARKED, completion_only=False)({"messages": CONVERSATIONS[1]})
  assert everything["mask"].all()


def test_fallback_template_on_sentencepiece(files):
  """Rendered by transformers' Jinja code, BOS/EOS text read as the tokens, the rest encoded by SentencePiece."""
  import sentencepiece as spm
  from transformers.utils.chat_template_utils import render_jinja_template

  sp = spm.SentencePieceProcessor(model_file=str(files / "spm.model"))
  template, where = template_lib.find_template("", "", str(files / "spm.model"))
  assert template == template_lib.FALLBACK_TEMPLATE and "fallback" in where
  conversation = _conversation(files, template, tokenizer="spm")
  turns = CONVERSATIONS[1]
  text = render_jinja_template([turns], chat_template=template, bos_token="<s>", eos_token="</s>")[0][0]
  assert text.startswith("<s>System: You are") and "\nAssistant: Hamlet</s>\nUser: And" in text
  want = [sp.bos_id()]
  for i, piece in enumerate(text[len("<s>") :].split("</s>")):
    want += ([sp.eos_id()] if i else []) + sp.encode(piece)
  got = conversation({"messages": turns})
  np.testing.assert_array_equal(got["tokens"], want)
  spans = np.split(got["tokens"], np.flatnonzero(np.diff(got["mask"])) + 1)[1::2]  # the runs of mask 1
  # Each assistant reply and its EOS (SentencePiece reads the newline after it as the next piece's space).
  assert [sp.decode(s.tolist()) for s in spans] == ["Hamlet", "Ophelia"]
  assert [s[-1] for s in spans] == [sp.eos_id()] * 2


def test_plain_prompt_and_completion(files):
  import sentencepiece as spm

  sp = spm.SentencePieceProcessor(model_file=str(files / "spm.model"))
  record = {"question": "Which book? The sea", "answer": " Genesis"}
  got = _conversation(files, None, tokenizer="spm", columns=("question", "answer"))(json.dumps(record).encode())
  prompt, completion = sp.encode(record["question"]), sp.encode(record["answer"])
  np.testing.assert_array_equal(got["tokens"], [sp.bos_id(), *prompt, *completion, sp.eos_id()])
  np.testing.assert_array_equal(got["mask"], [0] * (1 + len(prompt)) + [1] * (len(completion) + 1))


@pytest.mark.parametrize(
  "record, message",
  [
    ({"text": "x"}, "a record has no column 'messages'"),
    ({"messages": [{"role": "user", "content": "x"}]}, "has no assistant turn"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "system", "content": "y"}]}, "system turn at position 1"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "turn 0 of a conversation"),
    ({"messages": "hello"}, "not a list of"),
  ],
)
def test_bad_records_name_the_problem(files, record, message):
  with pytest.raises(ConfigError, match=message):
    _conversation(files, CHATML)(record)


def test_template_errors_are_config_errors(files):
  with pytest.raises(ConfigError, match="does not parse"):
    template_lib.compile_template("{% for m in messages %}")
  conversation = _conversation(files, MARKED)
  with pytest.raises(ConfigError, match="refuses a conversation .bad role"):
    conversation({"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]})
  with pytest.raises(ConfigError, match="use_chat_template=true"):
    sft.check_columns(["messages"], "train_data_columns", use_chat_template=False)
  with pytest.raises(ConfigError, match=r"\['prompt', 'completion'\]"):
    sft.check_columns(["prompt"], "eval_data_columns", use_chat_template=True)


def test_template_sources_in_order(files, tmp_path):
  tokenizer = str(files / "hf/tokenizer.json")
  assert template_lib.find_template("{{ x }}", "", tokenizer) == ("{{ x }}", "chat_template")
  (tmp_path / "t.jinja").write_text("J")
  assert template_lib.find_template("", str(tmp_path / "t.jinja"), tokenizer)[0] == "J"
  (tmp_path / "c.json").write_text(json.dumps({"chat_template": [{"name": "default", "template": "D"}]}))
  assert template_lib.find_template("", str(tmp_path / "c.json"), tokenizer)[0] == "D"
  assert template_lib.find_template("", "", tokenizer)[0] == CHATML
  (tmp_path / "none.json").write_text("{}")
  with pytest.raises(ConfigError, match="holds no chat_template"):
    template_lib.find_template("", str(tmp_path / "none.json"), tokenizer)
  with pytest.raises(ConfigError, match="does not exist"):
    template_lib.find_template("", str(tmp_path / "missing.jinja"), tokenizer)


def _records(n=6):
  """Conversations of different lengths, single and multi-turn."""
  turns = [t for c in CONVERSATIONS for t in c if t["role"] != "system"]
  return [{"messages": [{"role": "user", "content": f"{i} " + turns[i % 4]["content"]}, *CONVERSATIONS[i % 2][-2 + i % 2 :]]}
          for i in range(n)]  # fmt: skip


def _batches(conversation, records, rows, packing):
  dataset = text_pipeline.make_dataset(
    records, tokenize=conversation, length=64, rows=rows, seed=0, num_epochs=1, process_index=0, process_count=1,
    shuffle=False, packing=packing, examples="conversations",
  )  # fmt: skip
  return list(dataset)


def _per_token_losses(model, params, batches):
  """{(conversation's input tokens): its targets' losses (0 outside the mask)}, and the summed loss's gradients."""
  import jax
  import jax.numpy as jnp

  losses, grads = {}, None
  for batch in batches:

    def total(p, batch=batch):
      logits, _ = model.apply({"params": p}, batch["inputs"], batch["inputs_segmentation"], batch["inputs_position"],
                              deterministic=True, mutable=["intermediates"])  # fmt: skip
      per_token = jnp.where(batch["targets_segmentation"] != 0, losses_lib.cross_entropy(logits, batch["targets"]), 0.0)
      return jnp.sum(per_token), per_token

    (_, per_token), g = jax.value_and_grad(total, has_aux=True)(params)
    grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
    for r, segments in enumerate(batch["inputs_segmentation"]):
      for s in np.unique(segments[segments > 0]):
        where = segments == s
        losses[tuple(batch["inputs"][r, where])] = np.asarray(per_token[r, where])
  return losses, grads


def test_packed_and_unpacked_batches_give_the_same_losses_and_gradients(files):
  import jax

  from MaxText.layers import models

  conversation = _conversation(files, CHATML)
  records = _records()
  packed, unpacked = _batches(conversation, records, 1, True), _batches(conversation, records, 6, False)
  assert len(unpacked) == 1 and len(packed) < 6 and packed[0]["inputs_segmentation"].max() > 1, "the test needs packing"
  cfg = config("vocab_size=512", "override_model_config=true")
  model = models.Transformer(cfg)
  params = model.init({"params": jax.random.key(0)}, *models.init_inputs(1, 64))["params"]
  losses_p, grads_p = _per_token_losses(model, params, packed)
  losses_u, grads_u = _per_token_losses(model, params, unpacked)
  assert sorted(losses_p) == sorted(losses_u) and len(losses_u) == len(records)
  for key, want in losses_u.items():
    np.testing.assert_allclose(losses_p[key], want, rtol=1e-5, atol=1e-6)
  for got, want in zip(jax.tree.leaves(grads_p), jax.tree.leaves(grads_u), strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_completion_only_puts_exactly_the_assistant_tokens_in_the_loss(files):
  conversation = _conversation(files, MARKED)
  records = _records()
  batch = _batches(conversation, records, 6, False)[0]
  for r, record in enumerate(records):
    example = conversation(record)
    n = len(example["tokens"]) - 1
    np.testing.assert_array_equal(batch["inputs"][r, :n], example["tokens"][:-1])
    np.testing.assert_array_equal(batch["targets_segmentation"][r, :n], example["mask"][1:])  # target t+1 in the loss
    assert not batch["targets_segmentation"][r, n:].any()
    assert batch["inputs_segmentation"][r, :n].all()  # attention still sees the prompt


def _write_jsonl(path, records):
  with open(path, "w", encoding="utf-8") as f:
    f.writelines(json.dumps(r) + "\n" for r in records)


def _sft_args(files, tmp_path, *extra):
  _write_jsonl(tmp_path / "train.jsonl", _records(40))
  _write_jsonl(tmp_path / "eval.jsonl", _records(8))
  yml = os.path.join(os.path.dirname(BASE_YML), "sft.yml")
  return [yml, *overrides_of(
    "hf_path=json", f"hf_train_files={tmp_path}/train.jsonl", f"hf_eval_files={tmp_path}/eval.jsonl",
    f"tokenizer_path={files}/hf/tokenizer.json", "tokenizer_type=huggingface", "vocab_size=512",
    "override_model_config=true", "per_device_batch_size=2", "learning_rate=1e-3", f"base_output_directory={tmp_path}/out",
    *extra,
  )]  # fmt: skip


def _train(args):
  import sys

  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  proc = run([sys.executable, "MaxText/train.py", *args], env)
  return proc.returncode, proc.stdout, proc.stderr


@pytest.mark.slow
def test_sft_trains_evaluates_and_resumes_from_the_command_line(files, tmp_path):
  """configs/sft.yml on Hugging Face json lines: the loss falls, eval runs, and a resumed run repeats the losses."""
  from MaxText.tests.helpers import metrics_losses

  common = ("eval_interval=6", "eval_steps=2", "enable_checkpointing=true", "checkpoint_period=6")
  common += ("learning_rate_schedule_steps=12",)  # the same schedule for the run stopped at 6
  rc, out, err = _train(_sft_args(files, tmp_path, "run_name=a", "steps=12", f"metrics_file={tmp_path}/a.jsonl", *common))
  assert rc == 0, err
  straight = metrics_losses(tmp_path / "a.jsonl")
  assert straight[11] < straight[0]
  evals = [m for m in map(json.loads, open(tmp_path / "a.jsonl", encoding="utf-8")) if "eval/avg_loss" in m]
  assert [m["step"] for m in evals] == [5, 11]
  rc, _, err = _train(_sft_args(files, tmp_path, "run_name=b", "steps=6", f"metrics_file={tmp_path}/b.jsonl", *common))
  assert rc == 0, err
  rc, out, err = _train(_sft_args(files, tmp_path, "run_name=b", "steps=12", f"metrics_file={tmp_path}/b.jsonl", *common))
  assert rc == 0 and "resumed from" in out, err
  assert metrics_losses(tmp_path / "b.jsonl") == straight


@pytest.mark.slow
@pytest.mark.parametrize(
  "change, message",
  [
    (
      "train_data_columns=['prompt','completion']",
      "train_data_columns=['prompt', 'completion']: a record has no column 'prompt'",
    ),
    ("use_chat_template=false", "train_data_columns=['messages'] needs a chat template"),
    ("chat_template={{", "the chat template does not parse"),
    ("eval_data_columns=['text']", "eval_data_columns=['text'] does not name a conversation"),
    ("no_assistant", "train_data_columns: a conversation has no assistant turn"),
    ("dataset_type=synthetic", "use_sft=true trains on conversations"),
    ("lora_rank=64", "lora_rank=64 is not below the model's smallest projection width"),
    ("too_long", "train.jsonl fits max_target_length=64; the shortest needs"),
  ],
)
def test_bad_sft_input_exits_2_with_one_line_and_writes_nothing(files, tmp_path, change, message):
  args = _sft_args(files, tmp_path, "run_name=bad", "steps=2", "eval_interval=2", "enable_checkpointing=true")
  if change == "no_assistant":
    _write_jsonl(tmp_path / "train.jsonl", [{"messages": [{"role": "user", "content": "hello"}]}] * 4)
  elif change == "too_long":  # every prompt past max_target_length=64: no batch could ever be made
    _write_jsonl(tmp_path / "train.jsonl", _long_conversations())
  else:
    args.append(change)
  assert_refused(args, tmp_path, message)


def assert_refused(args, tmp_path, message):
  """train.py with `args` exits 2 with one line holding `message`, and writes nothing."""
  rc, out, err = _train(args)
  assert rc == 2, (out, err)
  assert err.count("\n") == 1 and message in err, err
  assert not os.path.exists(tmp_path / "out")


def test_grain_and_hf_give_the_same_conversation_batches_and_resume_exactly(files, tmp_path):
  """JSON records in ArrayRecord files and Hugging Face json lines: the same batches; Grain's state resumes them."""
  from array_record.python.array_record_module import ArrayRecordWriter

  from MaxText.tests.input_pipeline_test import _assert_resumes_exactly, _first_batch

  records = _records(30)
  _write_jsonl(tmp_path / "train.jsonl", records)
  writer = ArrayRecordWriter(str(tmp_path / "train.array_record"), "group_size:1")
  for record in records:
    writer.write(json.dumps(record).encode("utf-8"))
  writer.close()
  common = ("use_sft=true", "use_chat_template=true", "sft_train_on_completion_only=true", "train_data_columns=['messages']",
            f"tokenizer_path={files}/hf/tokenizer.json", "tokenizer_type=huggingface", "vocab_size=512",
            "override_model_config=true", "per_device_batch_size=4")  # fmt: skip
  grain_cfg = config("dataset_type=grain", f"grain_train_files={tmp_path}/train.array_record", *common)
  hf_cfg = config("dataset_type=hf", "hf_path=json", f"hf_train_files={tmp_path}/train.jsonl", *common)
  want = _first_batch(grain_cfg)
  assert want["inputs_segmentation"].max() > 1 and (want["targets_segmentation"] != want["inputs_segmentation"]).any()
  got = _first_batch(hf_cfg)
  for key, value in want.items():
    np.testing.assert_array_equal(got[key], value, err_msg=key)
  for cfg in (grain_cfg, hf_cfg):
    _assert_resumes_exactly(cfg)


def test_decode_prompts_go_through_the_chat_template(files):
  from MaxText.inference import prompts

  reference = _reference(files, CHATML)
  tokenizer = tokenizer_lib.load(str(files / "hf/tokenizer.json"), "huggingface")
  common = (f"tokenizer_path={files}/hf/tokenizer.json", "tokenizer_type=huggingface")
  templated = prompts.prompt_tokens(config(*common, "use_chat_template=true"), tokenizer, ["Which book?", "Who?"])
  for prompt, got in zip(["Which book?", "Who?"], templated, strict=True):
    turns = [{"role": "user", "content": prompt}]
    assert got == list(reference.apply_chat_template(turns, add_generation_prompt=True)["input_ids"])
  plain = prompts.prompt_tokens(config(*common, "add_bos=true"), tokenizer, ["Which book?"])
  assert plain == [[tokenizer.bos_id, *tokenizer.encode("Which book?")]]


def _long_conversations(n=20, words=200, seed=0):
  """`n` conversations whose user turn is `words` words long."""
  rng = np.random.default_rng(seed)
  vocab = WORDS.split()
  return [{"messages": [{"role": "user", "content": " ".join(rng.choice(vocab, words - 10 * (i % 3)))},
                        {"role": "assistant", "content": "Genesis"}]} for i in range(n)]  # fmt: skip


def _hf_sft_config(files, path, *extra):
  return config("use_sft=true", "use_chat_template=true", "sft_train_on_completion_only=true", "dataset_type=hf",
                "train_data_columns=['messages']", "hf_path=json", f"hf_train_files={path}", "vocab_size=512",
                f"tokenizer_path={files}/hf/tokenizer.json", "tokenizer_type=huggingface", "override_model_config=true",
                "per_device_batch_size=2", *extra)  # fmt: skip


def _first_batch_or_error(cfg, check=True):
  """The first batch of the data layer train.py uses (check(), then create_iterator, with the objective's
  examples), within a deadline."""
  import jax

  from MaxText import input_pipeline, objectives, sharding

  examples = objectives.get(cfg).examples
  with deadline(60):
    if check:
      input_pipeline.check(cfg, examples)
    return next(input_pipeline.create_iterator(cfg, sharding.create_mesh(cfg, jax.devices()[:1]), examples=examples))


def test_the_sft_objective_checks_its_conversations_before_the_run(files, tmp_path):
  """objective=sft and MaxText's use_sft=true are one objective, whose records are conversations: a record that is
  not one is refused by its start checks (train.py runs them before writing anything), naming the record."""
  from MaxText import objectives

  records = _records(6)
  _write_jsonl(tmp_path / "train.jsonl", records)
  for keys in (("use_sft=true",), ("use_sft=false", "objective=sft")):
    objective = objectives.get(_hf_sft_config(files, tmp_path / "train.jsonl", *keys))
    assert type(objective) is sft_objective.SupervisedFineTuning and objective.examples.name == "conversations"
    objective.check_start()
  records[2] = {"messages": [{"role": "user", "content": "hello"}]}
  _write_jsonl(tmp_path / "train.jsonl", records)
  with pytest.raises(ConfigError, match=r"^train_data_columns: a conversation has no assistant turn.*\(record 3 of"):
    objectives.get(_hf_sft_config(files, tmp_path / "train.jsonl", "objective=sft")).check_start()


def test_data_of_which_no_record_fits_is_one_error_not_a_spin(files, tmp_path):
  """20 conversations of 200 words, max_target_length=64: check() refuses them before the run, and an iterator made
  without check() raises the same error instead of reading forever. The length named is the shortest prompt as
  transformers tokenizes it (the first target in the loss); one token less is still refused, at it a batch comes."""
  records = _long_conversations()
  _write_jsonl(tmp_path / "long.jsonl", records)
  reference = _reference(files, CHATML)
  shortest = min(len(reference.apply_chat_template(r["messages"][:1], add_generation_prompt=True)["input_ids"])
                 for r in records)  # fmt: skip
  assert shortest > 64
  want = f"no record of hf_train_files={tmp_path}/long.jsonl fits max_target_length=64; the shortest needs {shortest} tokens"
  for check in (True, False):
    with pytest.raises(ConfigError, match=re.escape(want)):
      _first_batch_or_error(_hf_sft_config(files, tmp_path / "long.jsonl"), check=check)
  with pytest.raises(ConfigError, match=f"fits max_target_length={shortest - 1};"):
    _first_batch_or_error(_hf_sft_config(files, tmp_path / "long.jsonl", f"max_target_length={shortest - 1}"))
  batch = _first_batch_or_error(_hf_sft_config(files, tmp_path / "long.jsonl", f"max_target_length={shortest}"))
  assert np.asarray(batch["targets_segmentation"]).any()


def test_records_without_a_loss_target_are_one_error(files, tmp_path):
  """Plain prompt + completion with an empty completion and add_eos=false: no target in the loss at any length."""
  _write_jsonl(tmp_path / "empty.jsonl", [{"prompt": f"Which book? {i}", "completion": ""} for i in range(5)])
  cfg = _hf_sft_config(files, tmp_path / "empty.jsonl", "use_chat_template=false", "add_eos=false",
                       "train_data_columns=['prompt','completion']")  # fmt: skip
  for check in (True, False):
    with pytest.raises(ConfigError, match=f"no record of hf_train_files={tmp_path}/empty.jsonl has a target in the loss"):
      _first_batch_or_error(cfg, check=check)


@pytest.mark.parametrize(
  "record, message",
  [
    ({"prompt": None, "completion": "x"}, "column 'prompt' is null, not a string"),
    ({"prompt": "x", "completion": 3}, "column 'completion' is 3, not a string"),
    ({"prompt": "x", "completion": ["a"]}, "column 'completion' is [\"a\"], not a string"),
  ],
)
def test_plain_columns_of_another_type_name_the_column(files, record, message):
  with pytest.raises(ConfigError, match=re.escape(message)):
    _conversation(files, None, tokenizer="spm", columns=("prompt", "completion"))(record)


@pytest.mark.parametrize(
  "content, message",
  [
    (b"hello world\nthis is not json\n", "long.jsonl line 1 is not JSON"),
    (b'{"messages": []}\n{"messages": [}\n', "long.jsonl line 2 is not JSON"),
    (b"[1, 2]\n", "long.jsonl line 1 is a JSON list, not an object of columns"),
    (b"\x00" * 64 + b"\n", "long.jsonl line 1 is not JSON"),
    (bytes(range(255, -1, -1)) * 4, "long.jsonl line 1 is not UTF-8 (byte 0"),
    (b"\n \n\n", "long.jsonl holds no records"),
    (b'[{"messages": [}]', "long.jsonl is not JSON"),
  ],
  ids=["text", "bad-line-2", "array", "nul", "binary", "blank", "bad-array"],
)
def test_a_data_file_that_is_not_json_lines_is_one_line_naming_it(files, tmp_path, content, message):
  (tmp_path / "long.jsonl").write_bytes(content)
  with pytest.raises(ConfigError) as error:
    _first_batch_or_error(_hf_sft_config(files, tmp_path / "long.jsonl"))
  text = str(error.value)
  assert message in text and "\n" not in text and "write one JSON object per line" in text, text
  assert text.startswith(f"hf_train_files={tmp_path}/long.jsonl "), text


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "folder"])
def test_a_data_path_that_is_not_a_regular_file_is_never_opened(files, tmp_path, kind):
  path = {"fifo": tmp_path / "data.jsonl", "dev-zero": "/dev/zero", "folder": tmp_path}[kind]
  if kind == "fifo":
    os.mkfifo(path)
  with pytest.raises(ConfigError) as error:
    _first_batch_or_error(_hf_sft_config(files, path))
  words = {"fifo": "is not a regular file (it is a FIFO)", "dev-zero": "is not a regular file (it is a character device)",
           "folder": "matches the folder"}  # fmt: skip
  assert words[kind] in str(error.value)
  with pytest.raises(ConfigError, match="chat_template_path=/dev/zero is not a regular file"):
    template_lib.find_template("", "/dev/zero", str(files / "hf/tokenizer.json"))


def test_check_names_the_record_it_refuses(files, tmp_path):
  records = _records(6)
  records[4] = {"messages": [{"role": "user", "content": "hello"}]}
  _write_jsonl(tmp_path / "train.jsonl", records)
  with pytest.raises(ConfigError) as error:
    _first_batch_or_error(_hf_sft_config(files, tmp_path / "train.jsonl"))
  assert str(error.value).startswith("train_data_columns: a conversation has no assistant turn")
  assert str(error.value).endswith(f"(record 5 of hf_train_files={tmp_path}/train.jsonl)")
