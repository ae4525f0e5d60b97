"""Tokenizers: tiktoken and Hugging Face files against their libraries, wrong files, and their users (a Grain
text pipeline, decode.py)."""

import base64
import json
import os

import numpy as np
import pytest

from MaxText import decode, train_tokenizer
from MaxText.common_types import ConfigError
from MaxText.input_pipeline import tokenizer as tokenizer_lib
from MaxText.tests.helpers import BASE_YML, config, overrides

TEXTS = [
  "the theory of the thermos",
  "We'll see: 12345 apples, 6.7 pears!\n\nNew\tline  ",
  "héllo wörld 🙂 日本語",
  "<|end_of_text|> is text here",
  "",
]

# Llama 3's pre-tokenisation regex and special tokens, spelled out from Meta's llama3 tokenizer.py.
META_PATTERN = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
META_SPECIALS = [
  "<|begin_of_text|>",
  "<|end_of_text|>",
  "<|reserved_special_token_0|>",
  "<|reserved_special_token_1|>",
  "<|finetune_right_pad_id|>",
  "<|step_id|>",
  "<|start_header_id|>",
  "<|end_header_id|>",
  "<|eom_id|>",
  "<|eot_id|>",
  "<|python_tag|>",
] + [f"<|reserved_special_token_{i}|>" for i in range(2, 247)]
MERGES = [b"th", b"the", b" t", b" the", b"he", b"xx", b"  "]  # ranks 256.. in this order
N_RANKS = 256 + len(MERGES)


@pytest.fixture(autouse=True)
def tiktoken_cache(tmp_path, monkeypatch):
  """tiktoken keeps a copy of every file it loads under a key of its path; here, in the test's folder."""
  monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken_cache"))


def _write_bpe(path, merges):
  ranks = [bytes([b]) for b in range(256)] + merges
  path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(ranks)))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  """A tiny tiktoken BPE file, a Hugging Face tokenizer.json (+ tokenizer_config.json) and a SentencePiece model."""
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers, processors, trainers

  root = tmp_path_factory.mktemp("tokenizers")
  _write_bpe(root / "tokenizer.model", MERGES)

  hf = tokenizers.Tokenizer(models.BPE())
  hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  hf.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(
    vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
  )
  hf.train_from_iterator([t for t in TEXTS * 20 if t], trainer)
  # The library's own encode adds <s> ... </s> through this post-processor; ours must not.
  hf.post_processor = processors.TemplateProcessing(
    single="<s> $A </s>", special_tokens=[("<s>", hf.token_to_id("<s>")), ("</s>", hf.token_to_id("</s>"))]
  )
  os.makedirs(root / "hf")
  hf.save(str(root / "hf/tokenizer.json"))
  special = {"bos_token": "<s>", "eos_token": {"content": "</s>", "lstrip": False, "special": True}, "pad_token": None}
  (root / "hf/tokenizer_config.json").write_text(json.dumps(special))
  os.makedirs(root / "hf_bare")
  hf.save(str(root / "hf_bare/tokenizer.json"))  # no tokenizer_config.json: no BOS/EOS/pad

  texts = [f"The {w} of the sea is {n}." for n in range(50) for w in ("sun", "moon")]
  train_tokenizer.train(texts, vocab_size=290, output=str(root / "spm.model"))
  return root


# ------------------------------------------------------------------------------------------ tiktoken
def _meta_encoding(path):
  import tiktoken
  from tiktoken.load import load_tiktoken_bpe

  ranks = load_tiktoken_bpe(str(path))
  specials = {token: len(ranks) + i for i, token in enumerate(META_SPECIALS)}
  return tiktoken.Encoding("reference", pat_str=META_PATTERN, mergeable_ranks=ranks, special_tokens=specials)


def test_tiktoken_matches_a_direct_encoding_and_hand_merges(files):
  tok = tokenizer_lib.load(str(files / "tokenizer.model"), "tiktoken")
  reference = _meta_encoding(files / "tokenizer.model")
  # By hand: "the" merges t+h (256) then th+e (257); " the" goes on to " "+"the" (259); bytes are their own ranks.
  assert tok.encode("the") == [257] and tok.encode(" the") == [259] and tok.encode("the the") == [257, 259]
  assert tok.encode("a") == [97] and tok.encode("é") == list("é".encode())
  for text in TEXTS:
    ids = tok.encode(text)
    assert ids == reference.encode(text, disallowed_special=()), text
    assert tok.decode(ids) == text
  assert N_RANKS + 1 not in tok.encode(TEXTS[3])  # a special token's text in a document stays text

  assert len(META_SPECIALS) == 256
  assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (N_RANKS, N_RANKS + 1, -1, N_RANKS + 256)
  for i, special in enumerate(META_SPECIALS):  # every special token's id, as Meta's table gives it
    assert reference.encode(special, allowed_special="all") == [N_RANKS + i] and tok.decode([N_RANKS + i]) == special


def test_tiktoken_encodes_long_runs_in_pieces(files):
  """tiktoken's regex runs out of backtracking stack on a million spaces; text goes in pieces, as in Meta's."""
  tok = tokenizer_lib.load(str(files / "tokenizer.model"), "tiktoken")
  reference = _meta_encoding(files / "tokenizer.model")
  text = "the" + " " * 1_000_000 + "the" + "x" * 60_000 + " end"
  ids = tok.encode(text)
  assert tok.decode(ids) == text
  # Meta's cuts: every 400k characters, then 25k characters into each longer run of (non-)whitespace of a
  # 400k chunk, counted from where the run starts in that chunk. The "xx" and "  " merges pair characters,
  # so a cut one character off changes the ids.
  runs = [*range(25_003, 400_000, 25_000), *range(425_000, 800_000, 25_000), *range(825_000, 1_000_003, 25_000)]
  bounds = sorted({0, 400_000, 800_000, *runs, 1_000_003 + 25_000, 1_000_003 + 50_000, len(text)})
  pieces = [text[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
  assert ids == [t for piece in pieces for t in reference.encode(piece)]


def test_tiktoken_reads_a_changed_file_again(tmp_path):
  """tiktoken's cache is keyed by path: a file rewritten in place must not be served from the old copy."""
  path = tmp_path / "tokenizer.model"
  _write_bpe(path, [])
  assert tokenizer_lib.load(str(path), "tiktoken").encode("th") == [116, 104]
  _write_bpe(path, [b"th"])
  assert tokenizer_lib.load(str(path), "tiktoken").encode("th") == [256]


# ------------------------------------------------------------------------------------------ Hugging Face
def test_huggingface_matches_the_library_and_reads_special_tokens_from_its_config(files):
  import tokenizers

  path = str(files / "hf/tokenizer.json")
  tok = tokenizer_lib.load(path, "huggingface")
  library = tokenizers.Tokenizer.from_file(path)
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (library.token_to_id("<s>"), library.token_to_id("</s>"), -1)
  assert tok.bos_id >= 0 and tok.eos_id >= 0 and tok.bos_id != tok.eos_id
  assert tok.vocab_size == library.get_vocab_size(with_added_tokens=True)
  for text in TEXTS:
    ids = tok.encode(text)
    assert ids == library.encode(text, add_special_tokens=False).ids, text
    assert library.encode(text).ids == [tok.bos_id, *ids, tok.eos_id]  # the post-processor's, not ours
    assert tok.decode(ids) == text
  assert len(tok.encode(TEXTS[0])) < len(TEXTS[0])  # merges were learnt: the check can tell BPE from bytes

  bare = tokenizer_lib.load(str(files / "hf_bare/tokenizer.json"), "huggingface")
  assert (bare.bos_id, bare.eos_id, bare.pad_id) == (-1, -1, -1)
  assert bare.encode(TEXTS[1]) == tok.encode(TEXTS[1])


def test_huggingface_config_naming_an_unknown_token_is_a_config_error(tmp_path, files):
  (tmp_path / "tokenizer.json").write_bytes((files / "hf/tokenizer.json").read_bytes())
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|nope|>"}))
  with pytest.raises(ConfigError, match="names bos_token='<|nope|>'"):
    tokenizer_lib.load(str(tmp_path / "tokenizer.json"), "huggingface")


def test_huggingface_end_ids_add_generation_configs_and_say_where_from(tmp_path, files):
  """A generation_config.json beside tokenizer.json adds its eos_token_id (one id or a list, as transformers'
  generate() reads it) to the tokenizer's EOS; the line a run prints names each id's token and file. Without one,
  the EOS alone; a bad one is one ConfigError naming the file and the fix."""
  import tokenizers

  library = tokenizers.Tokenizer.from_file(str(files / "hf/tokenizer.json"))
  eos, pad = library.token_to_id("</s>"), library.token_to_id("<pad>")
  alone = tokenizer_lib.load(str(files / "hf/tokenizer.json"), "huggingface")
  assert alone.end_ids == (eos,) and alone.describe_end() == f"stops at </s> ({eos}), tokenizer_config.json's eos_token"
  (tmp_path / "tokenizer.json").write_bytes((files / "hf/tokenizer.json").read_bytes())
  (tmp_path / "tokenizer_config.json").write_bytes((files / "hf/tokenizer_config.json").read_bytes())
  for listed in ([pad, eos], pad):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": listed, "bos_token_id": 1}))
    tok = tokenizer_lib.load(str(tmp_path / "tokenizer.json"), "huggingface")
    assert tok.end_ids == tuple(sorted({pad, eos})) and tok.eos_id == eos
    said = {
      eos: f"</s> ({eos}), tokenizer_config.json's eos_token"
      + (" and generation_config.json's eos_token_id" * (listed != pad)),
      pad: f"<pad> ({pad}), generation_config.json's eos_token_id",
    }
    assert tok.describe_end() == "stops at " + "; ".join(said[i] for i in sorted(said)), listed
  bare = tokenizer_lib.load(str(files / "hf_bare/tokenizer.json"), "huggingface")
  assert bare.end_ids == () and "stops at no token" in bare.describe_end()
  for bad in ('{"eos_token_id": "2"}', '{"eos_token_id": [1, 100000]}', "{not json"):
    (tmp_path / "generation_config.json").write_text(bad)
    with pytest.raises(ConfigError, match="generation_config.json") as e:
      tokenizer_lib.load(str(tmp_path / "tokenizer.json"), "huggingface")
    assert "\n" not in str(e.value) and "fix or remove it" in str(e.value)


def test_sentencepiece_through_the_interface(files):
  import sentencepiece as spm

  model = spm.SentencePieceProcessor(model_file=str(files / "spm.model"))
  tok = tokenizer_lib.load(str(files / "spm.model"))
  assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (2, 1, 0, 290)  # as train_tokenizer sets them
  for text in TEXTS:
    assert tok.encode(text) == model.encode(text, out_type=int)
  assert tok.decode(tok.encode("The sun of the sea is 7.")) == "The sun of the sea is 7."


# ------------------------------------------------------------------------------------------ check_tokenizer
@pytest.mark.parametrize(
  "file, tokenizer_type, message",
  [
    ("hf/tokenizer.json", "sentencepiece", "is not a SentencePiece model (.*); set tokenizer_type=huggingface"),
    ("hf/tokenizer.json", "tiktoken", "is not a tiktoken BPE file .*; set tokenizer_type=huggingface"),
    ("tokenizer.model", "sentencepiece", "; set tokenizer_type=tiktoken"),
    ("tokenizer.model", "huggingface", "is not a Hugging Face tokenizer.json .*; set tokenizer_type=tiktoken"),
    ("spm.model", "tiktoken", "; set tokenizer_type=sentencepiece"),
    ("spm.model", "huggingface", "; set tokenizer_type=sentencepiece"),
    ("hf/tokenizer_config.json", "huggingface", "is not a Hugging Face tokenizer.json .*; give a Hugging Face"),
    ("missing.json", "huggingface", "does not exist; give a Hugging Face tokenizer.json"),
    ("hf", "huggingface", "is a folder; give a Hugging Face tokenizer.json file inside it"),
    ("spm.model", "bpe", "tokenizer_type='bpe' is not supported; choose one of 'sentencepiece', 'tiktoken'"),
  ],
)
def test_a_wrong_file_or_type_is_one_config_error_naming_the_fix(files, file, tokenizer_type, message):
  with pytest.raises(ConfigError, match=message) as e:
    tokenizer_lib.load(str(files / file), tokenizer_type)
  assert "\n" not in str(e.value)


def _config(files, file, tokenizer_type, *args):
  return config(
    "dataset_type=grain",
    f"tokenizer_path={files / file}",
    f"tokenizer_type={tokenizer_type}",
    "override_model_config=true",
    *args,
  )


@pytest.mark.parametrize(
  "file, tokenizer_type, args, message",
  [
    ("tokenizer.model", "tiktoken", ("vocab_size=512",), f"has {N_RANKS + 256} tokens but vocab_size=512"),
    ("hf_bare/tokenizer.json", "huggingface", (), "has no BOS token but add_bos=true; set add_bos=false, or name a bos"),
    ("hf_bare/tokenizer.json", "huggingface", ("add_bos=false",), "has no EOS token but add_eos=true; set add_eos=false"),
    ("hf/tokenizer.json", "huggingface", ("vocab_size=64",), "has 300 tokens but vocab_size=64"),
  ],
)
def test_check_tokenizer_refuses_what_the_run_cannot_use(files, file, tokenizer_type, args, message):
  with pytest.raises(ConfigError, match=message):
    tokenizer_lib.check_tokenizer(_config(files, file, tokenizer_type, "vocab_size=1024", *args))


def test_check_tokenizer_accepts_each_type_and_tokenize_adds_bos_and_eos(files):
  for file, tokenizer_type in (
    ("tokenizer.model", "tiktoken"),
    ("hf/tokenizer.json", "huggingface"),
    ("spm.model", "sentencepiece"),
  ):
    cfg = _config(files, file, tokenizer_type, "vocab_size=1024")
    tok = tokenizer_lib.check_tokenizer(cfg)
    ids = tokenizer_lib.Tokenize.from_config(cfg)(b"the theory")
    assert ids.dtype == np.int32 and ids.tolist() == [tok.bos_id, *tok.encode("the theory"), tok.eos_id], tokenizer_type


# ------------------------------------------------------------------------------------------ users
def test_grain_pipeline_with_a_huggingface_tokenizer(tmp_path, files):
  """Every packed piece of the first batch is [BOS] + the library's ids + [EOS] of one document, shifted."""
  import jax
  import tokenizers
  from array_record.python.array_record_module import ArrayRecordWriter

  from MaxText import input_pipeline, sharding

  documents = [f"the {w} {n}" for n in range(30) for w in ("theory", "thermos")]
  os.makedirs(tmp_path / "train")
  writer = ArrayRecordWriter(str(tmp_path / "train/data.array_record-00000-of-00001"), "group_size:1")
  for doc in documents:
    writer.write(doc.encode("utf-8"))
  writer.close()
  cfg = _config(
    files,
    "hf/tokenizer.json",
    "huggingface",
    f"grain_train_files={tmp_path}/train/*",
    "vocab_size=512",
    "max_target_length=32",
    "per_device_batch_size=2",
  )
  input_pipeline.check(cfg)
  mesh = sharding.create_mesh(cfg, jax.devices()[:1])
  batch = {k: np.asarray(v) for k, v in next(input_pipeline.create_iterator(cfg, mesh)).items()}

  library = tokenizers.Tokenizer.from_file(str(files / "hf/tokenizer.json"))
  bos, eos = library.token_to_id("<s>"), library.token_to_id("</s>")
  expected = {tuple([bos, *library.encode(d, add_special_tokens=False).ids, eos]) for d in documents}
  assert max(len(e) for e in expected) <= 33, "every document must fit one piece for this check"
  seen = 0
  for row in range(batch["inputs"].shape[0]):
    segments = batch["inputs_segmentation"][row]
    for segment in np.unique(segments[segments > 0]):
      where = segments == segment
      inputs, targets = batch["inputs"][row, where].tolist(), batch["targets"][row, where].tolist()
      assert tuple([*inputs, targets[-1]]) in expected and inputs[1:] == targets[:-1]
      seen += 1
  assert seen >= 4


@pytest.mark.parametrize(
  "file, tokenizer_type, message",
  [
    ("hf/tokenizer.json", "sentencepiece", "is not a SentencePiece model"),
    ("spm.model", "wordpiece", "tokenizer_type='wordpiece' is not supported"),
  ],
)
def test_decode_with_a_wrong_tokenizer_type_exits_2_with_one_line(files, capsys, file, tokenizer_type, message):
  args = ("run_name=x", "max_target_length=48", "max_prefill_predict_length=32", "vocab_size=512")
  args += ("override_model_config=true", f"tokenizer_path={files / file}", f"tokenizer_type={tokenizer_type}")
  code = decode.main(["decode.py", BASE_YML, *overrides(*args)])
  _, err = capsys.readouterr()
  assert code == 2
  assert len(err.strip().splitlines()) == 1 and message in err, err
