"""On how few TPU chips a model decodes, with float or weight-only quantized weights: the decode step compiled for
TPU slices that are not here (libtpu, on this host's CPU), largest first, until one does not fit.

    python3 end_to_end/quantized_decode_memory_tpu.py [--model llama3.1-70b] [--topologies v5e-16,v5e-8,v5e-4]
      [--quantizations bf16,int8w] [--batch 8] [--cache_length 2048] [key=value ...]

The step is one token of every row of a batch with a contiguous KV cache of cache_length slots per row: the model
in autoregressive mode (models.Transformer, MODEL_MODE_AUTOREGRESSIVE) applied to the cache, its new keys and
values written in, the next tokens picked greedily. With int8w/int4w the model is quantizations.quantize_model's
(qwix PTQ) and its parameters the abstract quantized tree of that model's init (jax.eval_shape): int8 values and a
float scale per output channel, never materialised. Weights and activations are bfloat16; the parameters are
split over tensor parallelism (min(8, chips, kv heads): the cache's kv heads split the same way) times fsdp (the
rest), the cache over its batch (fsdp) and kv heads (tensor).

Prints one markdown row per compile: per chip, XLA's arguments (parameters, cache), temporaries and peak against
the chip's HBM, and whether it fits (XLA refusing to compile for want of HBM counts as does not fit). The same
figures train_compile.py prints for a train step; decode has no train step, so it is compiled here. "compile" is
lowering and compiling. --quick (CI, a few seconds; needs libtpu, as train_compile.py does): the tiny model on a
v5e-4.
"""

import argparse
import dataclasses
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # No metadata server here: libtpu must not wait for one.

import jax  # noqa: E402 (after the path and environment above)
import jax.numpy as jnp  # noqa: E402
from flax import linen as nn  # noqa: E402

from MaxText import common_types as ct  # noqa: E402
from MaxText import compiled_step, metrics, pyconfig, sharding, tpu_topology  # noqa: E402
from MaxText import state as state_lib  # noqa: E402
from MaxText.layers import models, quantizations  # noqa: E402

BASE_YML = os.path.join(REPO, "MaxText", "configs", "base.yml")
GiB = 2**30
CACHE_AXES = ("layers", "cache_batch", "cache_sequence", "cache_heads", "cache_kv")


@dataclasses.dataclass(frozen=True)
class DecodeFit:
  """One compile's verdict, per chip (bytes; None where XLA refused to compile)."""

  topology: str
  quantization: str
  arguments: int | None
  temporaries: int | None
  needed: int | None  # XLA's peak (or its "Used" figure when it refused)
  hbm: int
  fits: bool
  seconds: float


def load_config(model: str, topology: str, quantization: str, cache_length: int, extra: list[str]):
  """The model's config finalized for the topology's devices, with a tensor x fsdp mesh for decoding."""
  chips = tpu_topology.parse(topology).chips
  values = pyconfig.parse([BASE_YML, f"model_name={model}", "weight_dtype=bfloat16", "dtype=bfloat16"])
  tensor = min(8, chips, values["base_num_kv_heads"])
  argv = [BASE_YML, f"model_name={model}", f"compile_topology={topology}", f"quantization={quantization}"]
  argv += ["weight_dtype=bfloat16", "dtype=bfloat16", "attention=dot_product", "matmul_precision=default"]
  argv += [f"max_target_length={cache_length}", f"ici_tensor_parallelism={tensor}", "ici_fsdp_parallelism=-1"]
  argv += ["run_name=decode_compile", "jax_cache_dir=", *extra]
  return pyconfig.finalize({**pyconfig.parse(argv), "hardware": "tpu"}, num_devices=chips)


def decode_step(model: nn.Module):
  """(params, cache, lengths [batch], tokens [batch, 1]) -> (next tokens [batch], cache, lengths + 1)."""

  def step(params, cache, lengths, tokens):
    batch, slots = tokens.shape[0], cache[0].shape[2]
    cache_positions = jnp.broadcast_to(jnp.arange(slots, dtype=jnp.int32), (batch, slots))
    logits, new = model.apply(
      {"params": params},
      tokens,
      jnp.ones_like(tokens),
      lengths[:, None],
      cache=cache,
      cache_mask=cache_positions < lengths[:, None],
      cache_positions=cache_positions,
    )
    rows = jnp.arange(batch)
    cache = tuple(c.at[:, rows, lengths].set(n[:, :, 0].astype(c.dtype)) for c, n in zip(cache, new, strict=True))
    return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache, lengths + 1

  return step


def lower_decode(config, batch: int) -> jax.stages.Lowered:
  """The decode step of `config` (quantized by its `quantization`) lowered for its compile_topology's devices."""
  topology = tpu_topology.parse(config.compile_topology)
  devices = tpu_topology.devices(topology)
  mesh = sharding.create_mesh(config, devices)
  init_model = quantizations.quantize_model(models.Transformer(config, mesh), config)
  params, params_shardings = state_lib.params_layout(init_model, config, mesh)
  model = quantizations.quantize_model(models.Transformer(config, mesh, ct.MODEL_MODE_AUTOREGRESSIVE), config)
  cache_sharding = sharding.logical_sharding(CACHE_AXES, mesh, config)
  shape = (config.num_decoder_layers, batch, config.max_target_length, config.num_kv_heads, config.head_dim)
  cache = tuple(jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=cache_sharding) for _ in range(2))
  rows = sharding.logical_sharding(("cache_batch",), mesh, config)
  lengths = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=rows)
  tokens = jax.ShapeDtypeStruct(
    (batch, 1), jnp.int32, sharding=sharding.logical_sharding(("cache_batch", None), mesh, config)
  )
  step = jax.jit(
    decode_step(model),
    in_shardings=(params_shardings, (cache_sharding,) * 2, rows, tokens.sharding),
    out_shardings=(rows, (cache_sharding,) * 2, rows),
    donate_argnums=(1, 2),
  )
  return step.lower(params, cache, lengths, tokens)


def compile_decode(config, batch: int) -> DecodeFit:
  """The decode step compiled, and what it needs per chip against the chip's HBM."""
  hbm = metrics.device_memory_bytes(tpu_topology.devices(tpu_topology.parse(config.compile_topology))[0])
  name = config.quantization or "bf16"
  start = time.time()
  try:
    compiled = lower_decode(config, batch).compile()
  except jax.errors.JaxRuntimeError as e:
    needed = compiled_step.out_of_memory(e)
    if needed is None:
      raise
    return DecodeFit(config.compile_topology, name, None, None, needed[0], hbm, False, time.time() - start)
  seconds = time.time() - start
  memory = compiled.memory_analysis()
  peak = compiled_step.step_bytes_per_device(compiled, "tpu")
  return DecodeFit(
    config.compile_topology,
    name,
    memory.argument_size_in_bytes,
    memory.temp_size_in_bytes,
    peak,
    hbm,
    peak <= hbm,
    seconds,
  )


def _gib(n: int | None) -> str:
  """GiB, or MiB below a tenth of one (the tiny model's)."""
  if n is None:
    return ""
  return f"{n / GiB:.2f} GiB" if n >= GiB / 10 else f"{n / 2**20:.2f} MiB"


def row(fit: DecodeFit) -> str:
  verdict = "fits" if fit.fits else ("XLA: out of HBM" if fit.arguments is None else "DOES NOT FIT")
  cells = (fit.quantization, fit.topology, _gib(fit.arguments), _gib(fit.temporaries), _gib(fit.needed), _gib(fit.hbm))
  return f"| {' | '.join(cells)} | {verdict} | {fit.seconds:.0f} s |"


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
  parser.add_argument("--model", default="llama3.1-70b")
  parser.add_argument("--topologies", default="v5e-16,v5e-8,v5e-4", help="largest first; stops after one misfit")
  parser.add_argument("--quantizations", default="bf16,int8w", help="bf16 (none), int8w, int4w")
  parser.add_argument("--batch", type=int, default=8, help="rows decoded at once (the whole slice)")
  parser.add_argument("--cache_length", type=int, default=2048, help="KV cache slots per row")
  parser.add_argument("--quick", action="store_true", help="CI: the tiny model on a v5e-4, 4 rows x 128 slots")
  args, extra = parser.parse_known_args()
  if args.quick:
    args.model, args.topologies, args.batch, args.cache_length = "tiny", "v5e-4", 4, 128
  jax.config.update("jax_platforms", "cpu")  # The slice's devices come from libtpu; JAX itself stays on the CPU.
  jax.config.update("jax_enable_compilation_cache", False)
  print(f"{args.model}: decode of {args.batch} rows x {args.cache_length} cache slots (bf16 KV cache)", flush=True)
  print("| weights | topology | arguments | temporaries | peak | HBM | verdict | compile |")
  print("|---|---|---|---|---|---|---|---|", flush=True)
  for quantization in args.quantizations.split(","):
    for topology in args.topologies.split(","):
      q = "" if quantization == "bf16" else quantization
      fit = compile_decode(load_config(args.model, topology, q, args.cache_length, extra), args.batch)
      print(row(fit), flush=True)
      if not fit.fits:
        break
  return 0


if __name__ == "__main__":
  sys.exit(main())
