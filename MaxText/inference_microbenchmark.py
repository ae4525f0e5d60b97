"""Times decoding's stages, as MaxText's script of the same name:

    python3 MaxText/inference_microbenchmark.py MaxText/configs/base.yml \
      inference_microbenchmark_prefill_lengths=64,128 inference_microbenchmark_batch_sizes=1,8 [key=value ...]

Parameters come from load_parameters_path (or load_full_state_path) when given, else a random init. For
each global batch size and prompt length it times (median of inference_microbenchmark_loop_iters runs):
  - prefill: one forward pass over full-length prompts that fills the cache;
  - generate: one cached step (batch tokens), and the compiled generate loop per step;
and reports tokens/s and, for a step, the bytes it must read (parameters + the whole KV cache) over its
time: the memory bandwidth used, and its fraction of the device's peak where that is known
(memory_bandwidth_gbps, or metrics.DEVICE_PEAKS).
"""

import json
import statistics
import sys
import time

if __package__ in (None, ""):  # Run as a script: see MaxText/script_path.py.
  import script_path  # noqa: F401

import jax
import numpy as np
from flax import linen as nn

from MaxText import checkpointing, cli, metrics, sharding, storage
from MaxText import state as state_lib
from MaxText.common_types import Config, ConfigError
from MaxText.inference import decoding
from MaxText.layers import models


def _ints(key: str, text: str) -> list[int]:
  try:
    values = [int(x) for x in text.split(",") if x.strip()]
  except ValueError:
    values = []
  if not values or min(values) < 1:
    raise ConfigError(f"{key}={text!r} is not a comma-separated list of positive integers, e.g. {key}=64,128")
  return values


def _median_seconds(fn, iters: int) -> float:
  times = []
  for _ in range(iters):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def _nbytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


def random_params(config: Config, mesh, dtype):
  model = models.Transformer(config, mesh)
  _, shardings = state_lib.params_layout(model, config, mesh)

  def init(rng):
    params = nn.meta.unbox(state_lib.init_params(model, config, rng))
    return jax.tree_util.tree_map(lambda x: x.astype(dtype), params)

  return jax.jit(init, out_shardings=shardings)(jax.random.key(config.init_weights_seed))


def benchmark(config: Config) -> list[dict]:
  decoding.check(config)
  lengths = _ints("inference_microbenchmark_prefill_lengths", config.inference_microbenchmark_prefill_lengths)
  batch_sizes = config.inference_microbenchmark_batch_sizes
  batches = _ints("inference_microbenchmark_batch_sizes", batch_sizes) if batch_sizes else [config.micro_batch_size]
  stages = [s.strip() for s in config.inference_microbenchmark_stages.split(",") if s.strip()]
  if not stages or set(stages) - {"prefill", "generate"}:
    raise ConfigError(f"inference_microbenchmark_stages={config.inference_microbenchmark_stages!r}: use prefill, generate")
  too_long = [n for n in lengths if n > config.max_prefill_predict_length]
  if too_long:
    raise ConfigError(
      f"inference_microbenchmark_prefill_lengths has {too_long[0]} > max_prefill_predict_length="
      f"{config.max_prefill_predict_length}; raise max_prefill_predict_length (and max_target_length)"
    )
  iters = config.inference_microbenchmark_loop_iters
  mesh = sharding.create_mesh(config)
  decoder = decoding.Decoder(config, mesh)
  if config.load_parameters_path or config.load_full_state_path:
    params, where = checkpointing.load_params(config, mesh, decoder.params_dtype())
  else:
    params, where = random_params(config, mesh, decoder.params_dtype()), "random init"
  shards = decoder.batch_shards()
  if any(b % shards for b in batches):
    raise ConfigError(
      f"inference_microbenchmark_batch_sizes={batch_sizes!r}: every batch must split over the {shards} data x fsdp "
      "shards of the mesh; give multiples of it"
    )
  device = mesh.devices.flat[0]
  peak = metrics.peak_bandwidth_gbps(device.device_kind, config.memory_bandwidth_gbps)
  print(f"Parameters: {where}, {_nbytes(params) / 1e6:.1f} MB; {len(mesh.devices.flat)} x {device.device_kind}", flush=True)

  results = []
  rng = np.random.default_rng(0)
  key = jax.random.key(config.decode_sampling_seed)
  for batch in batches:
    for length in lengths:
      tokens = rng.integers(1, config.vocab_size, (batch, length)).astype(np.int32)
      tokens, lens = decoder.put_batch(tokens, np.full((batch,), length, np.int32))
      row = {"batch": batch, "prefill_length": length}
      logits, cache = decoder.prefill(params, tokens, lens)  # compiles
      if "prefill" in stages:
        seconds = _median_seconds(lambda: decoder.prefill(params, tokens, lens), iters)
        row.update(prefill_ms=seconds * 1e3, prefill_tokens_per_s=batch * length / seconds)
      if "generate" in stages:
        next_tokens = jax.numpy.argmax(logits, -1).astype(jax.numpy.int32)
        step_bytes = _nbytes(params) + _nbytes((cache.keys, cache.values))
        step_seconds = _timed_steps(decoder, params, tokens, lens, next_tokens, iters)
        decoder.generate(params, cache, logits, key)  # compile
        loop_seconds = _median_seconds(lambda: decoder.generate(params, cache, logits, key), max(iters // 5, 1))
        steps = decoder.num_generated - 1
        per_device_gbps = step_bytes / step_seconds / 1e9 / len(mesh.devices.flat)
        row.update(
          step_ms=step_seconds * 1e3,
          step_tokens_per_s=batch / step_seconds,
          loop_ms_per_step=loop_seconds / steps * 1e3,
          loop_tokens_per_s=batch * steps / loop_seconds,
          bytes_per_step=step_bytes,
          bandwidth_gbps_per_device=per_device_gbps,
          bandwidth_fraction=per_device_gbps / peak if peak else None,
        )
      results.append(row)
      print(_describe(row), flush=True)
  if config.inference_microbenchmark_log_file_path:
    path = config.inference_microbenchmark_log_file_path
    log = {"device": device.device_kind, "devices": len(mesh.devices.flat), "results": results}
    storage.write_text(storage.expand(path), json.dumps(log, indent=1))
  return results


def _timed_steps(decoder, params, tokens, lens, next_tokens, iters: int) -> float:
  """Median seconds of one cached step, each on a fresh prefilled cache (a step donates its cache)."""
  times = []
  for _ in range(iters + 1):  # the first compiles
    cache = jax.block_until_ready(decoder.prefill(params, tokens, lens)[1])
    start = time.perf_counter()
    jax.block_until_ready(decoder.step(params, cache, next_tokens))
    times.append(time.perf_counter() - start)
  return statistics.median(times[1:])


def _describe(row: dict) -> str:
  parts = [f"batch {row['batch']}, prompt {row['prefill_length']}:"]
  if "prefill_ms" in row:
    parts.append(f"prefill {row['prefill_ms']:.2f} ms ({row['prefill_tokens_per_s']:.0f} tokens/s);")
  if "step_ms" in row:
    fraction = "n/a" if row["bandwidth_fraction"] is None else f"{row['bandwidth_fraction']:.1%}"
    parts.append(
      f"generate step {row['step_ms']:.2f} ms ({row['step_tokens_per_s']:.0f} tokens/s), "
      f"loop {row['loop_ms_per_step']:.2f} ms/step ({row['loop_tokens_per_s']:.0f} tokens/s); "
      f"{row['bytes_per_step'] / 1e6:.1f} MB/step = {row['bandwidth_gbps_per_device']:.1f} GB/s/device, "
      f"{fraction} of peak bandwidth"
    )
  return " ".join(parts)


def main(argv) -> int:
  return cli.run_cli(benchmark, argv)


if __name__ == "__main__":
  sys.exit(main(sys.argv))
