"""Sampling: `python3 MaxText/decode.py MaxText/configs/base.yml run_name=NAME load_parameters_path=PATH
tokenizer_path=PATH prompt="I love to" [key=value ...]`.

Loads parameters (load_parameters_path, else the latest checkpoint of run_name), decodes the prompt (or
every line of decode_prompts_file) with the KV cache and the compiled generate loop of inference/, and
prints ``Input `PROMPT` -> `OUTPUT` `` per prompt (control characters escaped, see `visible`), then the prefill
time, the time per generated token and tokens/s. autoregressive_decode_assert=TEXT exits 1 unless every output
as printed starts with TEXT.
"""

import sys
import time
import unicodedata

if __package__ in (None, ""):  # Run as a script: see MaxText/script_path.py.
  import script_path  # noqa: F401

import jax
import numpy as np

from MaxText import checkpointing, cli, sharding, storage
from MaxText.common_types import Config, ConfigError
from MaxText.inference import decoding
from MaxText.input_pipeline import tokenizer as tokenizer_lib


def load_tokenizer(config: Config) -> tokenizer_lib.Tokenizer:
  if not config.tokenizer_path:
    raise ConfigError(
      "decoding needs tokenizer_path=PATH and tokenizer_type= (the tokenizer the checkpoint was trained with)"
    )
  return tokenizer_lib.check_tokenizer(config)


def read_prompts(config: Config) -> list[str]:
  if not config.decode_prompts_file:
    return [config.prompt]
  path = storage.expand(config.decode_prompts_file)
  hint = "give a UTF-8 file with one prompt per line"
  if not storage.is_remote(path):
    storage.check_file("decode_prompts_file", path, hint)  # Never opens /dev/zero, a FIFO or a folder.
  elif not storage.isfile(path):
    raise ConfigError(f"decode_prompts_file={path} does not exist; {hint}")
  try:
    # A line's end is "\n" or "\r\n"; any other control character stays in its prompt.
    prompts = [line.removesuffix("\r") for line in storage.read_text(path).split("\n") if line.strip()]
  except UnicodeDecodeError as e:
    raise ConfigError(f"decode_prompts_file={path} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None
  if not prompts:
    raise ConfigError(f"decode_prompts_file={path} holds no prompt; write one prompt per line")
  return prompts


# Bidirectional embeddings, overrides and isolates: they reorder how a terminal shows the text around them.
_BIDI = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def visible(text: str) -> str:
  """`text` as printed: "\\n" stays a line break and printable text stays as it is; every other control character
  (C0 with tab and CR, DEL, C1) and bidirectional override becomes its Python escape (\\t, \\r, \\x1b, \\u202e),
  so a prompt or a generation cannot move the cursor, retitle or clear the terminal, or hide text. A backslash
  stays as it is: the output is for reading, not for parsing back."""
  return "".join(repr(c)[1:-1] if (unicodedata.category(c) == "Cc" and c != "\n") or c in _BIDI else c for c in text)


class Timer:
  def __init__(self):
    self.seconds = 0.0

  def __call__(self, fn, *args):
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    self.seconds += time.perf_counter() - start
    return out


def prompt_tokens(config: Config, tokenizer: tokenizer_lib.Tokenizer, prompts: list[str]) -> list[list[int]]:
  """Each prompt's tokens: [BOS] prompt, or with use_chat_template a user turn and the generation prompt."""
  if not config.use_chat_template:
    return [([tokenizer.bos_id] if config.add_bos else []) + tokenizer.encode(p) for p in prompts]
  from MaxText.input_pipeline import sft

  template, _ = sft.find_template(config.chat_template, config.chat_template_path, config.tokenizer_path)
  compiled = sft.compile_template(template)
  return [sft.render(compiled, tokenizer, [{"role": "user", "content": p}], add_generation_prompt=True) for p in prompts]


def decode(config: Config) -> int:
  decoding.check(config)
  tokenizer = load_tokenizer(config)
  prompts = read_prompts(config)
  ids = [np.asarray(tokens, np.int32) for tokens in prompt_tokens(config, tokenizer, prompts)]
  for text, tokens in zip(prompts, ids, strict=True):
    if len(tokens) == 0:
      raise ConfigError("the prompt is empty (and add_bos=false); give a prompt or set add_bos=true")
    if len(tokens) > config.max_prefill_predict_length:
      raise ConfigError(
        f"prompt {text[:40]!r} is {len(tokens)} tokens but max_prefill_predict_length="
        f"{config.max_prefill_predict_length}; shorten it or raise max_prefill_predict_length and max_target_length"
      )

  mesh = sharding.create_mesh(config)
  decoder = decoding.Decoder(
    config, mesh, eos_id=tokenizer.eos_id, pad_id=max(tokenizer.pad_id, 0), num_tokens=tokenizer.vocab_size
  )
  params, where = checkpointing.load_params(config, mesh, decoder.params_dtype())
  cli.log(f"Parameters from {where}")

  key = jax.random.key(config.decode_sampling_seed)
  batch = config.micro_batch_size
  prefill_time, generate_time, compile_time = Timer(), Timer(), Timer()
  steps = generated = 0  # loop steps run, and tokens they produced over all prompts
  outputs = []
  for start in range(0, len(ids), batch):
    chunk = ids[start : start + batch]
    tokens, lengths = decoder.put_batch(*decoding.pad_prompts(chunk, batch, config.max_prefill_predict_length))
    prefill = compile_time(lambda: decoder.prefill.lower(params, tokens, lengths).compile())
    logits, cache = prefill_time(prefill, params, tokens, lengths)
    generate = compile_time(lambda: decoder.generate.lower(params, cache, logits, key).compile())
    out, count = generate_time(generate, params, cache, logits, key)
    rows, count = decoder.fetch(out, count, len(chunk))
    steps += count - 1  # the first token comes from the prefill
    generated += sum(max(len(r) - 1, 0) for r in rows)  # tokens the loop produced
    outputs.extend(tokenizer.decode(r.tolist()) for r in rows)

  for text, output in zip(prompts, outputs, strict=True):
    cli.log(f"Input `{visible(text)}` -> `{visible(output)}`")
  per_step = generate_time.seconds / max(steps, 1)
  cli.log(
    f"Prefill: {prefill_time.seconds * 1e3:.1f} ms for {len(prompts)} prompt(s); generate: {steps} steps in "
    f"{generate_time.seconds:.3f} s, {per_step * 1e3:.2f} ms per generated token, "
    f"{generated / max(generate_time.seconds, 1e-9):.1f} tokens/s (batch {batch}); compile {compile_time.seconds:.1f} s"
  )
  expected = config.autoregressive_decode_assert
  if expected:  # Against the output as printed, escapes included: what the user sees is what they can assert.
    wrong = [shown for shown in map(visible, outputs) if not shown.startswith(expected)]
    if wrong:
      print(
        f"error: autoregressive_decode_assert: output '{wrong[0][:80]}' does not start with {expected!r}", file=sys.stderr
      )
      return 1
  return 0


def main(argv) -> int:
  return cli.run_cli(decode, argv)


if __name__ == "__main__":
  sys.exit(main(sys.argv))
