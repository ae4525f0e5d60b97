"""Throughput of the benchmark model's largest matmul (output projection) on this machine's CPU.

    python3 end_to_end/matmul_cpu_microbenchmark.py

[2048, 256] x [256, 32000] in bf16 with float32 accumulation, and in float32: the roofline against which
the training step's TFLOP/s in docs/changelog.md is read.
"""

import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # A CPU benchmark: never the TPU backend, even with libtpu installed.

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402


def main():
  x = jnp.ones((2048, 256), jnp.bfloat16)
  w = jnp.ones((256, 32000), jnp.bfloat16)
  bf16 = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32))
  f32 = jax.jit(lambda x, w: jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32)))
  for name, fn in (("bf16 x bf16 -> f32", bf16), ("f32 x f32 -> f32", f32)):
    fn(x, w).block_until_ready()
    start = time.time()
    for _ in range(10):
      fn(x, w).block_until_ready()
    seconds = (time.time() - start) / 10
    print(f"{name}: {2 * 2048 * 256 * 32000 / seconds / 1e9:.0f} GFLOP/s")


if __name__ == "__main__":
  main()
