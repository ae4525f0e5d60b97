"""Checkpoint conversion without transformers: train -> export -> import -> train again, and bad input.

The Hugging Face folders here are written by our own exporter from a trained tiny model (parity with
transformers itself is in hf_checkpoint_test.py).
"""

import json
import os
import stat

import jax
import numpy as np
import pytest
from flax import linen as nn

from MaxText import convert_hf_checkpoint, convert_to_hf_checkpoint, train
from MaxText.layers import decoders, models
from MaxText.tests.helpers import BASE_YML, config

TRAIN = ("steps=3", "learning_rate=1e-2", "warmup_steps_fraction=0", "per_device_batch_size=4", "dataset_type=synthetic")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  """(output dir, items of a 3-step tiny training run, its exported Hugging Face folder)."""
  root = tmp_path_factory.mktemp("convert")
  cfg = config(*TRAIN, "enable_checkpointing=true", "async_checkpointing=false", f"base_output_directory={root}")
  train.train(cfg, jax.devices()[:1])
  items = os.path.join(root, "test", "checkpoints", "3", "items")
  hf = str(root / "hf")
  # No run_name: the export writes only to hf_model_path.
  argv = ["export", BASE_YML, "model_name=tiny", f"load_full_state_path={items}", f"hf_model_path={hf}", "jax_cache_dir="]
  assert convert_to_hf_checkpoint.main(argv) == 0
  return root, items, hf


def _import(hf, out, run_name="imported"):
  argv = [
    "convert",
    BASE_YML,
    f"hf_model_path={hf}",
    f"base_output_directory={out}",
    f"run_name={run_name}",
    "jax_cache_dir=",
  ]
  return convert_hf_checkpoint.main(argv)


@pytest.mark.slow
def test_trained_then_exported_checkpoint_trains_on_with_the_same_losses(trained, tmp_path):
  """Training from the imported export gives bit-identical losses to training from the original params."""
  root, items, hf = trained
  assert _import(hf, tmp_path) == 0
  ckpt = os.path.join(tmp_path, "imported", "checkpoints", "0")
  devices = jax.devices()[:1]
  original = train.train(config(*TRAIN, f"load_parameters_path={items}", "run_name=a"), devices)
  imported = config(
    *TRAIN,
    f"model_name={ckpt}/model.yml",
    f"load_parameters_path={ckpt}/items",
    "run_name=b",
    "dtype=float32",
  )
  resumed = train.train(imported, devices)
  np.testing.assert_array_equal([x for _, x in resumed.losses], [x for _, x in original.losses])


def _copy(hf, dst):
  os.makedirs(dst)
  for name in os.listdir(hf):
    with open(os.path.join(hf, name), "rb") as f, open(os.path.join(dst, name), "wb") as g:
      g.write(f.read())
  return dst


def _edit_config(folder, **changes):
  path = os.path.join(folder, "config.json")
  with open(path) as f:
    cfg = json.load(f)
  with open(path, "w") as f:
    json.dump(cfg | changes, f)


def _remove_config_key(folder, key):
  path = os.path.join(folder, "config.json")
  with open(path) as f:
    cfg = json.load(f)
  del cfg[key]
  with open(path, "w") as f:
    json.dump(cfg, f)


def _drop_tensor(folder, name):
  from safetensors.numpy import load_file, save_file

  path = os.path.join(folder, "model.safetensors")
  tensors = load_file(path)
  del tensors[name]
  save_file(tensors, path, metadata={"format": "pt"})


def _bin_only(folder):
  os.remove(os.path.join(folder, "model.safetensors"))
  with open(os.path.join(folder, "pytorch_model.bin"), "wb") as f:
    f.write(b"not to be unpickled")


def _word_tokenizer(folder, size=4, template=None):
  """A WordLevel tokenizer.json of `size` tokens (<unk>, <s>, </s>, w3, ...) with its tokenizer_config.json, and
  a chat_template.jinja when given."""
  from tokenizers import Tokenizer, pre_tokenizers
  from tokenizers import models as tok_models

  vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, size)}
  tok = Tokenizer(tok_models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.save(os.path.join(folder, "tokenizer.json"))
  with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
    json.dump({"bos_token": "<s>", "eos_token": "</s>"}, f)
  if template is not None:
    with open(os.path.join(folder, "chat_template.jinja"), "w") as f:
      f.write(template)


def _write(folder, name, data: bytes):
  with open(os.path.join(folder, name), "wb") as f:
    f.write(data)


BAD = {
  "no_config": (lambda d: os.remove(os.path.join(d, "config.json")), "has no config.json"),
  "unsupported": (lambda d: _edit_config(d, model_type="bert", architectures=["BertModel"]), "model_type='bert'"),
  "missing_tensor": (lambda d: _drop_tensor(d, "model.layers.1.mlp.up_proj.weight"), "up_proj.weight is missing"),
  "shape_mismatch": (lambda d: _edit_config(d, intermediate_size=48), "has shape"),
  "bin_only": (_bin_only, "only .bin"),
  "extra_tensor": (lambda d: _edit_config(d, num_hidden_layers=1), "is not part of"),
  "no_hidden_size": (lambda d: _remove_config_key(d, "hidden_size"), "no 'hidden_size', which a llama model needs"),
  # A tokenizer the import would copy and print as the one to use must load as runs load it (issue 43).
  "garbage_tokenizer_json": (
    lambda d: _write(d, "tokenizer.json", b"not a tokenizer"),
    "the tokenizer does not load: ",
  ),
  "garbage_tokenizer_model": (
    lambda d: _write(d, "tokenizer.model", b"\n\x05junk"),
    "tokenizer.model is not a SentencePiece model",
  ),
  "unknown_tokenizer_model": (
    lambda d: _write(d, "tokenizer.model", b"junk"),
    "tokenizer.model is neither a SentencePiece model nor a tiktoken file",
  ),
  "garbage_tokenizer_config": (
    lambda d: (_word_tokenizer(d), _write(d, "tokenizer_config.json", b"{not json")),
    "tokenizer_config.json is not a JSON file",
  ),
  "tokenizer_bigger_than_the_model": (
    lambda d: _word_tokenizer(d, size=200),
    "has 200 tokens but config.json's vocabulary is 128",
  ),
  "template_does_not_parse": (
    lambda d: _word_tokenizer(d, template="{% for message in %}"),
    "chat_template.jinja: the chat template does not parse",
  ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_hugging_face_folder_exits_2_with_one_line_and_writes_nothing(case, trained, tmp_path, capsys):
  _, _, hf = trained
  folder = _copy(hf, str(tmp_path / "hf"))
  damage, message = BAD[case]
  damage(folder)
  out = tmp_path / "out"
  capsys.readouterr()
  assert _import(folder, out) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error:") and message in err[0], err
  assert not out.exists(), sorted(str(p.relative_to(tmp_path)) for p in out.rglob("*"))  # not even empty folders


def test_existing_checkpoint_is_never_overwritten(trained, tmp_path, capsys):
  _, _, hf = trained
  assert _import(hf, tmp_path) == 0
  items = tmp_path / "imported" / "checkpoints" / "0" / "items"
  before = sorted(os.listdir(items))
  capsys.readouterr()
  assert _import(hf, tmp_path) == 2
  assert "already exists" in capsys.readouterr().err
  assert sorted(os.listdir(items)) == before


def test_import_to_a_bucket_says_how(trained, capsys):
  """The importer stages a local folder and renames it into place: a gs:// output is refused before any work."""
  _, _, hf = trained
  assert _import(hf, "gs://some-bucket/runs") == 2
  assert "import locally, then copy the run folder to the bucket" in capsys.readouterr().err


def test_export_without_a_tokenizer_warns_and_writes_the_trained_length(trained, tmp_path, capsys):
  """Without tokenizer keys (README's old export command) config.json can name no BOS or EOS, so transformers'
  generate() would never stop: one warning line says so. max_position_embeddings is the length the model was
  trained at (64), not Llama 3.1's 8192 the export once wrote for any length."""
  _, items, _ = trained
  out = tmp_path / "hf"
  argv = ["export", BASE_YML, "model_name=tiny", f"load_full_state_path={items}", "max_target_length=64"]
  capsys.readouterr()
  assert convert_to_hf_checkpoint.main([*argv, f"hf_model_path={out}", "jax_cache_dir="]) == 0
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("warning: no tokenizer_path") and "generate() will not stop" in err[0]
  written = json.loads((out / "config.json").read_text())
  assert written["max_position_embeddings"] == 64
  assert written["bos_token_id"] is None and written["eos_token_id"] is None
  assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]


def test_export_refuses_a_non_empty_folder(trained, tmp_path, capsys):
  _, items, _ = trained
  (tmp_path / "taken").mkdir()
  (tmp_path / "taken" / "keep.txt").write_text("mine")
  argv = ["export", BASE_YML, "model_name=tiny", "run_name=x", f"load_full_state_path={items}", "jax_cache_dir="]
  assert convert_to_hf_checkpoint.main([*argv, f"hf_model_path={tmp_path / 'taken'}"]) == 2
  assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"


def test_export_refuses_a_folder_it_cannot_create(trained, tmp_path, capsys):
  _, items, _ = trained
  (tmp_path / "a_file").write_text("mine")
  argv = ["export", BASE_YML, "model_name=tiny", "run_name=x", f"load_full_state_path={items}", "jax_cache_dir="]
  capsys.readouterr()
  assert convert_to_hf_checkpoint.main([*argv, f"hf_model_path={tmp_path / 'a_file' / 'hf'}"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "a_file is a file, so no folder can be made there" in err[0], err
  assert (tmp_path / "a_file").read_text() == "mine"


def test_a_refused_import_keeps_the_folders_that_were_there(trained, tmp_path, capsys):
  """Only what the import made is removed: an existing run folder (with a file of its own) stays as it was."""
  _, _, hf = trained
  folder = _copy(hf, str(tmp_path / "hf"))
  _edit_config(folder, intermediate_size=48)
  (tmp_path / "out" / "imported").mkdir(parents=True)
  (tmp_path / "out" / "imported" / "notes.txt").write_text("mine")
  assert _import(folder, tmp_path / "out") == 2
  assert "has shape" in capsys.readouterr().err
  assert sorted(str(p.relative_to(tmp_path / "out")) for p in (tmp_path / "out").rglob("*")) == [
    "imported",
    os.path.join("imported", "notes.txt"),
  ]


@pytest.mark.parametrize("umask, shard_mb, weights", [(0o022, 5000, ["model.safetensors"]), (0o027, 0, None)])
def test_exported_files_get_the_mode_open_gives_under_the_umask(trained, tmp_path, umask, shard_mb, weights):
  """safetensors writes its files 0o600; the export's files all get what open() gives (0o666 less the umask), the
  weights as readable as config.json beside them (one model.safetensors, or shards of one tensor each)."""
  _, items, _ = trained
  argv = ["export", BASE_YML, "model_name=tiny", f"load_full_state_path={items}", "jax_cache_dir="]
  previous = os.umask(umask)
  try:
    assert (
      convert_to_hf_checkpoint.main([*argv, f"hf_model_path={tmp_path / 'hf'}", f"hf_max_shard_size_mb={shard_mb}"]) == 0
    )
  finally:
    os.umask(previous)
  names = sorted(os.listdir(tmp_path / "hf"))
  shards = [n for n in names if n.endswith(".safetensors")]
  assert "config.json" in names and (shards == weights if weights else len(shards) > 1), names
  modes = {name: oct(stat.S_IMODE(os.stat(tmp_path / "hf" / name).st_mode)) for name in names}
  assert modes == dict.fromkeys(names, oct(0o666 & ~umask))


def test_a_peft_adapter_folder_gets_the_mode_open_gives(tmp_path):
  """hf_lora_export=adapter: adapter_model.safetensors (safetensors: 0o600) as readable as adapter_config.json."""
  from MaxText import families, lora, state
  from MaxText.convert import peft

  cfg = config("lora_rank=2")
  rng = np.random.default_rng(0)
  params = jax.tree_util.tree_map(lambda a: rng.standard_normal(a.shape).astype(a.dtype), state.abstract_params(cfg))
  adapters = lora.partition(params)[0]
  previous = os.umask(0o027)
  try:
    count = peft.write_adapter(
      str(tmp_path), cfg, families.hf_mapping(cfg), adapters, lambda p, i: decoders.param_path(cfg, p, i)
    )
  finally:
    os.umask(previous)
  assert count == 2 * 7 * cfg.num_decoder_layers  # lora_a and lora_b of 7 projections per layer
  modes = {name: oct(stat.S_IMODE(os.stat(tmp_path / name).st_mode)) for name in os.listdir(tmp_path)}
  assert modes == dict.fromkeys([peft.CONFIG_FILE, peft.WEIGHTS_FILE], oct(0o640))


def test_large_tensors_are_imported_in_row_blocks_exactly(trained, tmp_path, monkeypatch):
  """With a tiny block size, the embedding and the (transposed) output projection are written in many row
  blocks, and the imported values are still exactly the source tensors."""
  from safetensors.numpy import load_file

  from MaxText import checkpointing

  _, _, hf = trained
  monkeypatch.setattr(convert_hf_checkpoint, "CHUNK_BYTES", 1000)  # 128 x 32 float32 tables -> 17 blocks each
  assert _import(hf, tmp_path) == 0
  ckpt = os.path.join(tmp_path, "imported", "checkpoints", "0")
  cfg = config(f"model_name={ckpt}/model.yml", f"load_parameters_path={ckpt}/items")
  abstract = jax.eval_shape(lambda: models.Transformer(cfg).init(jax.random.key(0), *models.init_inputs(1, 8)))
  params, _ = checkpointing.restore_host_params(cfg, nn.meta.unbox(abstract)["params"])
  source = load_file(os.path.join(hf, "model.safetensors"))
  np.testing.assert_array_equal(params["token_embedder"]["embedding"], source["model.embed_tokens.weight"])
  np.testing.assert_array_equal(params["logits_dense"]["kernel"], source["lm_head.weight"].T)


def test_importer_picks_the_tokenizer_type_from_the_files(trained, tmp_path, capsys):
  """A tokenizer.json makes tokenizer_type=huggingface; it is copied next to the checkpoint and loads there."""
  from tokenizers import Tokenizer, pre_tokenizers
  from tokenizers import models as tok_models

  from MaxText.input_pipeline import tokenizer as tokenizer_lib

  _, _, hf = trained
  folder = _copy(hf, str(tmp_path / "hf"))
  tok = Tokenizer(tok_models.WordLevel({"<unk>": 0, "<s>": 1, "hello": 2, "world": 3}, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.save(os.path.join(folder, "tokenizer.json"))
  with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
    json.dump({"bos_token": "<s>"}, f)
  capsys.readouterr()
  assert _import(folder, tmp_path / "out") == 0
  ckpt = tmp_path / "out" / "imported" / "checkpoints" / "0"
  assert f"tokenizer_type=huggingface tokenizer_path={ckpt / 'tokenizer.json'}" in capsys.readouterr().out
  loaded = tokenizer_lib.load(str(ckpt / "tokenizer.json"), "huggingface")
  assert loaded.encode("hello world") == [2, 3] and loaded.bos_id == 1
