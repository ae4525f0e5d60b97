"""Compares our forward pass with golden logits (e.g. Hugging Face transformers' on the same weights):

    python3 MaxText/tests/forward_pass_logit_checker.py MaxText/configs/base.yml model_name=MODEL \
      load_parameters_path=PATH/checkpoints/STEP/items [key=value ...] --golden_logits_path=FILE \
      [--atol=0.1] [--rtol=0.1] [--max_kl_div=KL]

FILE is JSON lines, one object per prompt: {"prompt": str, "tokens": [int], "logits": [[float]]}, logits
[len(tokens), vocab] (MaxText/generate_hf_golden_logits.py writes it). Each prompt's tokens run as one unpadded
row at positions 0..n-1. A prompt passes when every logit is within atol + rtol * |golden| (np.allclose;
MaxText's defaults atol = rtol = 0.1, loose enough for bfloat16 activations: pass dtype=float32 and tighter
tolerances to show float32 parity) and, with --max_kl_div, when KL(softmax(golden) || softmax(ours)) at every
position is at most KL. The `--` flags need `=`; nothing is written, so no run_name is needed.

Prints the max |difference|, max relative difference and max KL of each prompt. Exit code 0: all prompts
pass; 1: a prompt differs (one line with the prompt, position and amount); 2: a user mistake (missing or
malformed file, vocab size different from the model's, token out of range), one line.
"""

import dataclasses
import json
import os
import sys

if __package__ in (None, ""):  # Run as a script: see MaxText/script_path.py.
  import script_path  # noqa: F401

import jax
import numpy as np

from MaxText import checkpointing, cli, sharding
from MaxText import state as state_lib
from MaxText.common_types import Config, ConfigError
from MaxText.layers import models

FLAGS = {"golden_logits_path": str, "atol": float, "rtol": float, "max_kl_div": float}


@dataclasses.dataclass(frozen=True)
class Flags:
  golden_logits_path: str
  atol: float = 0.1
  rtol: float = 0.1
  max_kl_div: float | None = None  # None: the KL divergence is printed, not checked


@dataclasses.dataclass(frozen=True)
class Golden:
  prompt: str
  tokens: np.ndarray  # [length] int32
  logits: np.ndarray  # [length, vocab] float32


def parse_flags(args: list[str]) -> Flags:
  values = {}
  for arg in args:
    name, eq, value = arg[2:].partition("=")
    if name not in FLAGS or not eq:
      raise ConfigError(f"unknown flag {arg}; the flags are --golden_logits_path=FILE --atol=X --rtol=X --max_kl_div=X")
    try:
      values[name] = FLAGS[name](value)
    except ValueError:
      raise ConfigError(f"{arg}: {value!r} is not a number") from None
  if not values.get("golden_logits_path"):
    raise ConfigError("--golden_logits_path=FILE is missing; write FILE with MaxText/generate_hf_golden_logits.py")
  return Flags(**values)


def read_golden(path: str, vocab_size: int, max_length: int) -> list[Golden]:
  """The prompts of a golden JSON-lines file, checked against the model's vocab_size and max_target_length."""
  if not os.path.isfile(path):
    raise ConfigError(f"--golden_logits_path={path} does not exist; write it with MaxText/generate_hf_golden_logits.py")
  out = []
  with open(path, encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      where = f"{path} line {number}"
      try:
        row = json.loads(line)
        prompt, tokens, logits = str(row.get("prompt", "")), np.asarray(row["tokens"]), np.asarray(row["logits"], np.float32)
      except (ValueError, KeyError, TypeError, AttributeError) as e:  # bad JSON, missing key, ragged lists
        raise ConfigError(f"{where} is not a JSON object with tokens and logits ({type(e).__name__}: {e})") from None
      n = tokens.size
      if tokens.ndim != 1 or n == 0 or tokens.dtype.kind not in "iu" or logits.ndim != 2 or logits.shape[0] != n:
        raise ConfigError(
          f"{where}: want tokens [n] (integers, n > 0) and logits [n, vocab], got {tokens.shape} and {logits.shape}"
        )
      if logits.shape[1] != vocab_size:
        raise ConfigError(
          f"{where}: the logits have vocab {logits.shape[1]} but the model has vocab_size={vocab_size}; "
          "check model_name against the model the file was made with"
        )
      if tokens.min() < 0 or tokens.max() >= vocab_size:
        bad = tokens[(tokens < 0) | (tokens >= vocab_size)][0]
        raise ConfigError(f"{where}: token {bad} is outside the vocabulary [0, {vocab_size})")
      if n > max_length:
        raise ConfigError(f"{where}: {n} tokens but max_target_length={max_length}; raise max_target_length")
      out.append(Golden(prompt, tokens.astype(np.int32), logits))
  if not out:
    raise ConfigError(f"--golden_logits_path={path} holds no prompt; write one JSON object per line")
  return out


def log_softmax(logits_LV: np.ndarray) -> np.ndarray:
  x = logits_LV.astype(np.float64)
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def compare(index: int, golden: Golden, ours_LV: np.ndarray, flags: Flags) -> str | None:
  """Prints the prompt's differences; returns why it fails (one line), or None when it passes."""
  diff = np.abs(ours_LV - golden.logits)
  tolerance = flags.atol + flags.rtol * np.abs(golden.logits)  # np.allclose(ours, golden, rtol, atol)
  with np.errstate(divide="ignore", invalid="ignore"):
    relative = diff / np.abs(golden.logits)
  log_p, log_q = log_softmax(golden.logits), log_softmax(ours_LV)
  kl_L = np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)  # KL(golden || ours) at each position
  name = f"prompt {index}" + (f" {golden.prompt[:40]!r}" if golden.prompt else "") + f" ({len(golden.tokens)} tokens)"
  print(
    f"{name}: max |diff| {diff.max():.3g}, max relative diff {np.nanmax(relative):.3g}, max KL {kl_L.max():.3g}",
    flush=True,
  )
  excess = diff - tolerance
  if not np.all(excess <= 0):  # NaN fails too, as in np.allclose
    pos, vocab_id = np.unravel_index(np.argmax(np.nan_to_num(excess, nan=np.inf)), excess.shape)
    return (
      f"{name} position {pos} (token {golden.tokens[pos]}) logit {vocab_id}: ours {ours_LV[pos, vocab_id]:.6g}, "
      f"golden {golden.logits[pos, vocab_id]:.6g}, |diff| {diff[pos, vocab_id]:.3g} > atol + rtol * |golden| = "
      f"{tolerance[pos, vocab_id]:.3g}"
    )
  if flags.max_kl_div is not None and not np.all(kl_L <= flags.max_kl_div):
    pos = int(np.argmax(np.nan_to_num(kl_L, nan=np.inf)))
    kl = f"KL(golden || ours) {kl_L[pos]:.3g} > --max_kl_div={flags.max_kl_div}"
    return f"{name} position {pos} (token {golden.tokens[pos]}): {kl}"
  return None


def check(config: Config, flag_args: list[str]) -> int:
  flags = parse_flags(flag_args)
  goldens = read_golden(flags.golden_logits_path, config.vocab_size, config.max_target_length)
  mesh = sharding.create_mesh(config)
  model = models.Transformer(config, mesh)
  abstract, _ = state_lib.params_layout(model, config, mesh)
  params, where = checkpointing.restore_params(config, abstract)
  print(f"Parameters from {where}", flush=True)
  apply = jax.jit(model.apply)  # compiled once per prompt length
  failures = []
  for index, golden in enumerate(goldens):
    tokens_BL = golden.tokens[None]
    positions_BL = np.arange(tokens_BL.shape[1], dtype=np.int32)[None]
    ours_LV = np.asarray(apply({"params": params}, tokens_BL, np.ones_like(tokens_BL), positions_BL), np.float32)[0]
    failure = compare(index, golden, ours_LV, flags)
    if failure:
      failures.append(failure)
  if failures:
    print(f"error: {failures[0]}" + (f" ({len(failures)} prompts differ)" if len(failures) > 1 else ""), file=sys.stderr)
    return 1
  print(f"All {len(goldens)} prompts match (atol={flags.atol}, rtol={flags.rtol}, max_kl_div={flags.max_kl_div})")
  return 0


def main(argv) -> int:
  """argv: [program, config.yml, key=value ..., --flag=value ...]; the flags are kept from pyconfig."""
  flag_args = [a for a in argv[1:] if a.startswith("--")]
  config_args = [a for a in argv if not a.startswith("--")]
  return cli.run_cli(lambda config: check(config, flag_args), config_args)


if __name__ == "__main__":
  sys.exit(main(sys.argv))
