"""Times decoding's stages through the inference engine, as MaxText's script of the same name:

    python3 MaxText/inference_microbenchmark.py MaxText/configs/base.yml \
      inference_microbenchmark_prefill_lengths=64,128 inference_microbenchmark_batch_sizes=1,8 [key=value ...]

Parameters come from load_parameters_path (or load_full_state_path) when given, else a random init. For each
global batch size (an engine of that many slots) and prompt length it times, from the engine's own clocks
(`Engine.stats`, compilation counted apart and left out; median of inference_microbenchmark_loop_iters runs):
  - prefill: the prefill of `batch` fresh prompts of that length (each request's prefill, one after another);
  - generate: one dispatched decode step of every slot (an engine with steps_per_dispatch=1), and the compiled
    generate loop per step (steps_per_dispatch = the tokens a request generates, as decode.py runs it);
and reports tokens/s and, for a step, the bytes it must read (parameters + the whole paged KV cache) over its
time: the memory bandwidth used, and its fraction of the device's peak where that is known
(memory_bandwidth_gbps, or metrics.DEVICE_PEAKS).
"""

import json
import statistics
import sys

if __package__ in (None, ""):  # Run as a script: see MaxText/script_path.py.
  import script_path  # noqa: F401

import jax
import numpy as np
from flax import linen as nn

from MaxText import checkpointing, cli, metrics, pyconfig, sharding, storage
from MaxText import common_types as ct
from MaxText import state as state_lib
from MaxText.common_types import Config, ConfigError
from MaxText.inference import engine as engine_lib
from MaxText.inference.sampling import Sampling
from MaxText.layers import models


def _ints(key: str, text: str) -> list[int]:
  try:
    values = [int(x) for x in text.split(",") if x.strip()]
  except ValueError:
    values = []
  if not values or min(values) < 1:
    raise ConfigError(f"{key}={text!r} is not a comma-separated list of positive integers, e.g. {key}=64,128")
  return values


def _nbytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


def random_params(config: Config, mesh, dtype):
  model = models.Transformer(config, mesh)
  _, shardings = state_lib.params_layout(model, config, mesh)

  def init(rng):
    params = nn.meta.unbox(state_lib.init_params(model, config, rng))
    return jax.tree_util.tree_map(lambda x: x.astype(dtype), params)

  return jax.jit(init, out_shardings=shardings)(jax.random.key(config.init_weights_seed))


class _Clock:
  """Differences of an engine's stats over a stretch of its work (its run clocks never count compilation)."""

  def __init__(self, engine):
    self.engine, self.start = engine, dict(engine.stats)

  def delta(self, name: str) -> float:
    return self.engine.stats[name] - self.start.get(name, 0)

  def seconds(self, name: str) -> float:
    return self.delta(name)


def _requests(config: Config, rng, batch: int, length: int, max_tokens: int) -> list:
  """`batch` fresh random prompts (never a prefix-cache hit), sampled as the config says (decode.py's way)."""
  temperature, top_k, top_p = Sampling.from_config(config).request_settings()
  return [
    engine_lib.Request(
      tuple(int(t) for t in rng.integers(1, config.vocab_size, length)),
      max_tokens,
      temperature,
      top_k,
      top_p,
      config.decode_sampling_seed,
    )  # fmt: skip
    for _ in range(batch)
  ]


def _run(engine, requests) -> None:
  for request in requests:
    engine.submit(request, lambda _: None)
  while engine.busy():
    engine.run_once()


def _prefill_seconds(engine, config, rng, batch: int, length: int, iters: int) -> float:
  """Median seconds to prefill `batch` prompts of `length` (max_tokens=1: the prefill's token ends each)."""
  times = []
  for _ in range(iters + 1):  # the first compiles
    clock = _Clock(engine)
    _run(engine, _requests(config, rng, batch, length, 1))
    times.append(clock.seconds("prefill_seconds"))
  return statistics.median(times[1:])


def _step_seconds(engine, config, rng, batch: int, length: int, iters: int) -> float:
  """Median seconds of one dispatched step of all `batch` slots (an engine with steps_per_dispatch=1)."""
  times = []
  max_tokens = config.max_target_length - config.max_prefill_predict_length
  while len(times) < iters:
    for request in _requests(config, rng, batch, length, max_tokens):
      engine.submit(request, lambda _: None)
    while engine.busy() and len(times) < iters:
      clock = _Clock(engine)
      engine.run_once()
      if clock.delta("steps") == 1 and clock.delta("tokens") == batch and clock.delta("compile_seconds") == 0:
        times.append(clock.delta("generate_seconds"))
    while engine.busy():
      engine.run_once()
  return statistics.median(times)


def _loop(engine, config, rng, batch: int, length: int, iters: int) -> tuple[float, float]:
  """(seconds per step, tokens/s) of the compiled generate loop over whole requests, from the run of median
  seconds per step (the lower median: both figures come from one run)."""
  max_tokens = config.max_target_length - config.max_prefill_predict_length
  runs = []
  for i in range(iters + 1):  # the first compiles
    clock = _Clock(engine)
    _run(engine, _requests(config, rng, batch, length, max_tokens))
    if i:
      seconds = clock.seconds("generate_seconds")
      runs.append((seconds / clock.delta("steps"), clock.delta("tokens") / seconds))
  return statistics.median_low(runs)


def _batch_config(config: Config, batch: int, devices: int) -> Config:
  """`config` with `batch` decode slots (per_device_batch_size x devices)."""
  return config if batch == config.micro_batch_size else pyconfig.replace(config, per_device_batch_size=batch / devices)


def benchmark(config: Config) -> list[dict]:
  engine_lib.check(config)
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
  if "generate" in stages and config.max_target_length - config.max_prefill_predict_length < 2:
    raise ConfigError(
      f"max_target_length={config.max_target_length} leaves {config.max_target_length - config.max_prefill_predict_length}"
      " token(s) to generate, too few to time a decode step (the prefill samples the first); make it larger"
    )
  iters = config.inference_microbenchmark_loop_iters
  mesh = sharding.create_mesh(config)
  dtype = engine_lib.params_dtype(config, mesh)
  if config.load_parameters_path or config.load_full_state_path:
    params, where = checkpointing.load_params(config, mesh, dtype)
  else:
    params, where = random_params(config, mesh, dtype), "random init"
  shards = int(np.prod([mesh.shape[a] for a in sharding.mesh_axes_of(ct.CACHE_BATCH, config)], dtype=np.int64))
  if any(b % shards for b in batches):
    raise ConfigError(
      f"inference_microbenchmark_batch_sizes={batch_sizes!r}: every batch must split over the {shards} data x fsdp "
      "shards of the mesh; give multiples of it"
    )
  devices = len(mesh.devices.flat)
  device = mesh.devices.flat[0]
  peak = metrics.peak_bandwidth_gbps(device.device_kind, config.memory_bandwidth_gbps)
  print(f"Parameters: {where}, {_nbytes(params) / 1e6:.1f} MB; {devices} x {device.device_kind}", flush=True)

  results = []
  rng = np.random.default_rng(0)
  for batch in batches:
    cfg = _batch_config(config, batch, devices)
    step_engine = engine_lib.Engine(cfg, mesh, params, steps_per_dispatch=1, max_queue=batch)
    rows = [{"batch": batch, "prefill_length": length} for length in lengths]
    for row, length in zip(rows, lengths, strict=True):
      if "prefill" in stages:
        seconds = _prefill_seconds(step_engine, cfg, rng, batch, length, iters)
        row.update(prefill_ms=seconds * 1e3, prefill_tokens_per_s=batch * length / seconds)
      if "generate" in stages:
        step_seconds = _step_seconds(step_engine, cfg, rng, batch, length, iters)
        step_bytes = _nbytes(params) + _nbytes(step_engine.pool)
        per_device_gbps = step_bytes / step_seconds / 1e9 / devices
        row.update(
          step_ms=step_seconds * 1e3,
          step_tokens_per_s=batch / step_seconds,
          bytes_per_step=step_bytes,
          bandwidth_gbps_per_device=per_device_gbps,
          bandwidth_fraction=per_device_gbps / peak if peak else None,
        )
    del step_engine  # its KV cache, before the loop's engine takes one of its own
    if "generate" in stages:
      max_tokens = cfg.max_target_length - cfg.max_prefill_predict_length
      loop_engine = engine_lib.Engine(cfg, mesh, params, steps_per_dispatch=max_tokens, max_queue=batch)
      for row, length in zip(rows, lengths, strict=True):
        per_step, rate = _loop(loop_engine, cfg, rng, batch, length, max(iters // 5, 1))
        row.update(loop_ms_per_step=per_step * 1e3, loop_tokens_per_s=rate)
      del loop_engine
    for row in rows:
      results.append(row)
      print(_describe(row), flush=True)
  if config.inference_microbenchmark_log_file_path:
    path = config.inference_microbenchmark_log_file_path
    log = {"device": device.device_kind, "devices": devices, "results": results}
    storage.write_text(storage.expand(path), json.dumps(log, indent=1))
  return results


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
