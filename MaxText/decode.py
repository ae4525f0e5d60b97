"""Sampling: `python3 MaxText/decode.py MaxText/configs/base.yml run_name=NAME load_parameters_path=PATH
tokenizer_path=PATH prompt="I love to" [key=value ...]`.

Loads parameters (load_parameters_path, else the latest checkpoint of run_name), decodes the prompt (or
every line of decode_prompts_file) with the inference engine (inference/engine.py: the paged KV cache and the
compiled generate loop, per_device_batch_size x devices slots, refilled as prompts finish), and
prints ``Input `PROMPT` -> `OUTPUT` `` per prompt (control characters escaped, see `visible`), then the prefill
time, the time per generated token and tokens/s. autoregressive_decode_assert=TEXT exits 1 unless every output
as printed starts with TEXT.

quantization=int8w / int4w decodes with weight-only quantized parameters (quantized as they load, or loaded so with
checkpoint_is_quantized=true); with save_quantized_params_path=DIR it writes them there as a params checkpoint
instead (DIR/0/items, what load_parameters_path then takes with checkpoint_is_quantized=true) and decodes nothing.
"""

import sys
import unicodedata

if __package__ in (None, ""):  # Run as a script: see MaxText/script_path.py.
  import script_path  # noqa: F401


from MaxText import checkpointing, cli, sharding, storage
from MaxText.common_types import Config, ConfigError
from MaxText.inference import engine as engine_lib
from MaxText.inference import prompts as prompts_lib
from MaxText.inference.engine import counted
from MaxText.layers.linears import DTYPES


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


def save_quantized(config: Config) -> int:
  """save_quantized_params_path: the parameters quantized once (from weight_dtype, not a narrower decoding dtype)
  and written as a params checkpoint with their quantization settings."""
  directory = config.save_quantized_params_path  # absolute: a path key (config_parse.PATH_KEYS)
  checkpointing.check_new_params_dir("save_quantized_params_path", directory)  # before any work
  cli.check_writable("save_quantized_params_path", directory, folder=True)
  mesh = sharding.create_mesh(config)
  params, where = checkpointing.load_params(config, mesh, DTYPES[config.weight_dtype])
  path = checkpointing.save_quantized_params(config, engine_lib.serving_params(config, mesh, params))
  cli.log(f"Wrote the {config.quantization} parameters of {where} to {path}")
  return 0


def decode(config: Config) -> int:
  if config.save_quantized_params_path:
    return save_quantized(config)
  engine_lib.check(config)
  prompts = read_prompts(config)
  max_tokens = config.max_target_length - config.max_prefill_predict_length
  # Every step of a batch in one compiled loop (a slot that finishes while a prompt waits is refilled at once).
  engine, tokenizer = engine_lib.Engine.from_config(config, steps_per_dispatch=max_tokens, max_queue=len(prompts))
  ids = prompts_lib.prompt_tokens(config, tokenizer, prompts)
  for text, tokens in zip(prompts, ids, strict=True):
    if len(tokens) == 0:
      raise ConfigError("the prompt is empty (and add_bos=false); give a prompt or set add_bos=true")
    if len(tokens) > config.max_prefill_predict_length:
      raise ConfigError(
        f"prompt {text[:40]!r} is {len(tokens)} tokens but max_prefill_predict_length="
        f"{config.max_prefill_predict_length}; shorten it or raise max_prefill_predict_length and max_target_length"
      )
  cli.log(f"Parameters from {engine.loaded_from}")
  temperature, top_k, top_p = engine.default_sampling.request_settings()
  seed = config.decode_sampling_seed
  requests = [engine_lib.Request(tuple(p), max_tokens, temperature, top_k, top_p, seed) for p in ids]
  # Each output's text as the engine's output processor (inference/output.py, the server's too) decodes it, after
  # its prompt's tokens: prompt + output is their text (a SentencePiece output keeps the space of its first word).
  outputs = [result.text for result in engine.generate(requests)]

  for text, output in zip(prompts, outputs, strict=True):
    cli.log(f"Input `{visible(text)}` -> `{visible(output)}`")
  stats = engine.stats
  seconds, steps = stats["generate_seconds"], stats["steps"]
  cli.log(
    f"Prefill: {stats['prefill_seconds'] * 1e3:.1f} ms for {counted(len(prompts), 'prompt')}; generate: "
    f"{counted(steps, 'step')} in {seconds:.3f} s, {seconds / max(steps, 1) * 1e3:.2f} ms per generated token, "
    f"{stats['tokens'] / max(seconds, 1e-9):.1f} tokens/s ({counted(engine.num_slots, 'slot')}); compile "
    f"{stats['compile_seconds']:.1f} s"
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
