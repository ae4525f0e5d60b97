"""What checkpointing costs a training run: the core benchmark model (end_to_end/benchmark_cpu.py's config) for
40 steps without checkpoints, with asynchronous saves and with synchronous saves every 5 steps; the median step
time (steps after the first, the blocking part of saves excluded) and the goodput report of each run.

  python3 end_to_end/checkpoint_overhead_cpu.py [--rounds 2] [--devices 1] [--period 5]

Rounds alternate the variants, so drift of the machine's speed hits all of them.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "end_to_end"))
from side_by_side import CORE_CONFIG as CONFIG  # noqa: E402

DONE = re.compile(r"median step time ([\d.]+) s")
GOODPUT = re.compile(r"Goodput: ([\d.]+)% of ([\d.]+) s .* checkpoints ([\d.]+) s \(blocking")
VARIANTS = {
  "no checkpoints": ["enable_checkpointing=false"],
  "async saves": ["enable_checkpointing=true", "async_checkpointing=true"],
  "sync saves": ["enable_checkpointing=true", "async_checkpointing=false"],
}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--devices", type=int, default=1)
  parser.add_argument("--period", type=int, default=5, help="checkpoint_period")
  args = parser.parse_args()
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={args.devices}"}
  results = {name: [] for name in VARIANTS}
  for r in range(args.rounds):
    for name, extra in VARIANTS.items():
      with tempfile.TemporaryDirectory() as out:
        config = [a for a in CONFIG if not a.startswith(("steps=", "enable_checkpointing="))]
        cmd = [sys.executable, os.path.join(REPO, "MaxText", "train.py"), os.path.join(REPO, "MaxText/configs/base.yml")]
        cmd += [*config, "steps=40", f"checkpoint_period={args.period}", "log_period=1", "jax_cache_dir=", *extra]
        cmd += [f"run_name=overhead{r}", f"base_output_directory={out}", "enable_tensorboard=false", "log_config=false"]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if proc.returncode:
          raise SystemExit(f"{name}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
        step = float(DONE.search(proc.stdout).group(1))
        fraction, wall, blocking = (float(x) for x in GOODPUT.search(proc.stdout).groups())
        results[name].append((step, fraction, wall, blocking))
        print(f"round {r} {name:>15}: median step {step:.3f} s, goodput {fraction:.1f}% of {wall:.1f} s, "
              f"checkpoints blocking {blocking:.2f} s", flush=True)  # fmt: skip
  print(f"\nmedians over {args.rounds} rounds ({args.devices} device(s), a save every {args.period} steps of 40):")
  for name, runs in results.items():
    steps, fractions, _, blocking = zip(*runs, strict=True)
    median = sorted(steps)[len(steps) // 2]
    print(f"  {name:>15}: step {median:.3f} s, goodput {sorted(fractions)[len(fractions) // 2]:.1f}%, "
          f"checkpoints blocking {sorted(blocking)[len(blocking) // 2]:.2f} s")  # fmt: skip


if __name__ == "__main__":
  main()
