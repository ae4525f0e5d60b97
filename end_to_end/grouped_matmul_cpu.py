"""Grouped matmul on the CPU: layers/grouped_matmul.py's tiled implementation vs XLA's ragged_dot, forward and
backward: 8192 sorted rows of 256 over 8 experts of 256 x 1024, bfloat16 (the MoE benchmark's expert matrices;
its devices sort 2048 rows per layer, a quarter of these).

    python3 end_to_end/grouped_matmul_cpu.py [--repeats 3]        (--repeats 1 in CI)

Prints the median milliseconds of one forward and backward pass each, the time of one plain dot of all rows
by one matrix (the FLOPs a grouped matmul needs), and the largest difference between the two products.
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from MaxText.layers.grouped_matmul import grouped_matmul  # noqa: E402

ROWS, K, N = 8192, 256, 1024
SIZES = [1500, 0, 900, 1300, 1000, 1100, 1200, 1192]  # uneven, one expert empty: sums to ROWS


def timed(fn, args, repeats):
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((ROWS, K)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((len(SIZES), K, N)) / 16, jnp.bfloat16)
  sizes = jnp.asarray(SIZES, jnp.int32)
  matmuls = {
    "tiled (ours, CPU)": lambda x, w: grouped_matmul(x, w, sizes, platform="cpu"),
    "jax.lax.ragged_dot": lambda x, w: jax.lax.ragged_dot(x, w, sizes),
  }
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; rows {ROWS}, experts {len(SIZES)} of {K} x {N}")
  for name, matmul in matmuls.items():
    fwd = jax.jit(matmul)
    fwd_bwd = jax.jit(jax.value_and_grad(lambda x, w, m=matmul: jnp.sum(m(x, w).astype(jnp.float32)), (0, 1)))
    print(f"{name:<22} forward {timed(fwd, (x, w), args.repeats):7.1f} ms   forward+backward "
          f"{timed(fwd_bwd, (x, w), args.repeats):7.1f} ms")  # fmt: skip
  one = jax.jit(lambda x, w: x @ w[0])
  print(f"{'one dense dot':<22} forward {timed(one, (x, w), args.repeats):7.1f} ms (all rows by one matrix)")
  ours, xla = (np.asarray(jax.jit(m)(x, w), np.float32) for m in matmuls.values())
  print(f"largest difference between the two products: {np.max(np.abs(ours - xla)):.3g} "
        f"(largest output {np.max(np.abs(xla)):.3g}, bfloat16)")  # fmt: skip


if __name__ == "__main__":
  main()
