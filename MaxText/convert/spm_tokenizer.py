"""A SentencePiece model (tokenizer_type=sentencepiece: the demo's, MaxText/train_tokenizer.py's) as the Hugging Face
tokenizer.json and tokenizer_config.json the export writes, so that transformers splits text as our runs do.

transformers reads a bare tokenizer.model with a generic conversion that splits differently (the quick start's
"And God said" became 5 tokens instead of SentencePiece's 3, with no BOS): a silent mismatch between the exported
model and its tokenizer. Here the Unigram pieces and scores are kept, and SentencePiece's normalization (its
precompiled character map, extra whitespace removed and the dummy prefix "▁", each as its normalizer_spec says) is
written as tokenizers' normalizers; BOS, EOS, pad and unk are special tokens read as themselves, and a post-processor
puts BOS first when our runs add it (add_bos). One difference remains, as in end_to_end/lm_eval_tasks' converter:
SentencePiece never matches its byte and unknown pieces in text, where tokenizers' Unigram reads the literal text
"<0x41>" or "<unk>" as that piece. Only Unigram models convert; a BPE one (Llama 2's) is for transformers' own
LlamaTokenizer, and is copied as it is.
"""

import json
import os

TOKENIZER_JSON, TOKENIZER_CONFIG = "tokenizer.json", "tokenizer_config.json"
# Model types whose tokenizer transformers 5 builds as its own class whatever tokenizer_config.json names
# (transformers.models.auto.tokenization_auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS), among our families'.
TOKENIZER_CLASS_FORCED = ("qwen2",)


def _proto(model_path: str):
  from sentencepiece import sentencepiece_model_pb2

  proto = sentencepiece_model_pb2.ModelProto()
  with open(model_path, "rb") as f:
    proto.ParseFromString(f.read())
  return proto


def is_unigram(model_path: str) -> bool:
  """Whether the SentencePiece model at `model_path` is a Unigram one (the kind converted here)."""
  from sentencepiece import sentencepiece_model_pb2

  return _proto(model_path).trainer_spec.model_type == sentencepiece_model_pb2.TrainerSpec.UNIGRAM


def build(model_path: str, add_bos: bool):
  """(a `tokenizers.Tokenizer` that splits text as the Unigram SentencePiece model at `model_path` does, its special
  tokens {"bos_token": text, ...}); with `add_bos` its post-processor puts BOS first, as our runs do."""
  import tokenizers
  from tokenizers import Regex, decoders, normalizers, pre_tokenizers, processors

  proto = _proto(model_path)
  trainer, spec = proto.trainer_spec, proto.normalizer_spec
  model = tokenizers.models.Unigram(
    [(p.piece, p.score) for p in proto.pieces], unk_id=trainer.unk_id, byte_fallback=trainer.byte_fallback
  )
  tokenizer = tokenizers.Tokenizer(model)
  steps = [normalizers.Precompiled(spec.precompiled_charsmap)] if spec.precompiled_charsmap else []
  if spec.remove_extra_whitespaces:
    steps += [normalizers.Replace(Regex(" {2,}"), " "), normalizers.Strip(left=True, right=True)]
  if spec.add_dummy_prefix:
    steps.append(normalizers.Prepend(" "))
  tokenizer.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
  # No piece holds "▁" but at its start, so splitting before each "▁" leaves SentencePiece's best split unchanged.
  tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never", split=True)
  tokenizer.decoder = decoders.Sequence(
    [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
  )
  ids = {"bos_token": trainer.bos_id, "eos_token": trainer.eos_id, "pad_token": trainer.pad_id}
  ids["unk_token"] = trainer.unk_id
  specials = {name: proto.pieces[i].piece for name, i in ids.items() if i >= 0}
  tokenizer.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False) for t in specials.values()])
  if add_bos and "bos_token" in specials:
    bos = (specials["bos_token"], ids["bos_token"])
    tokenizer.post_processor = processors.TemplateProcessing(
      single=f"{bos[0]} $A", pair=f"{bos[0]} $A {bos[0]} $B", special_tokens=[bos]
    )
  return tokenizer, specials


def write(folder: str, model_path: str, add_bos: bool, max_length: int) -> list[str]:
  """Writes tokenizer.json and tokenizer_config.json for the Unigram SentencePiece model at `model_path` into
  `folder`; returns their names."""
  tokenizer, specials = build(model_path, add_bos)
  tokenizer.save(os.path.join(folder, TOKENIZER_JSON))
  settings = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length}
  settings |= {"clean_up_tokenization_spaces": False, **specials}
  with open(os.path.join(folder, TOKENIZER_CONFIG), "w", encoding="utf-8") as f:
    json.dump(settings, f, indent=2)
  return [TOKENIZER_JSON, TOKENIZER_CONFIG]
