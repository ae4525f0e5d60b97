"""What checkpointing costs a training run: the core benchmark model (end_to_end/benchmark_cpu.py's config) for
40 steps without checkpoints, with asynchronous saves and with synchronous saves every 5 steps; the median step
time (steps after the first, the blocking part of saves excluded) and the goodput report of each run.

  python3 end_to_end/checkpoint_overhead_cpu.py [--rounds 2] [--devices 1] [--period 5] [--steps 40] [--out DIR]
  python3 end_to_end/checkpoint_overhead_cpu.py --quick [--out DIR]

Rounds alternate the variants, so drift of the machine's speed hits all of them. Each run compiles afresh (no
persistent compilation cache), so each pays the same start-up. --out DIR keeps each run's folder, DIR/round<r>_<variant>
(its checkpoints, and the metrics_file metrics.jsonl that train.py writes there), instead of a temporary one.
--quick, the short mode (about 40 s on 2 CPU cores), makes the defaults one round of 6 steps with a save every 3, on
batches of 1 x 128 tokens (the same model), and lets the runs share one compilation cache: its figures check the
script, they do not measure what the full mode does.
"""

import argparse
import os
import re
import shutil
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


QUICK = {"per_device_batch_size": "1", "max_target_length": "128"}


def fail(message: str) -> None:
  """A mistake on the command line: one line, exit status 2."""
  print(f"error: {message}", file=sys.stderr)
  sys.exit(2)


def main() -> None:
  parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
  parser.add_argument("--rounds", type=int, default=None, help="default 2 (--quick: 1)")
  parser.add_argument("--devices", type=int, default=1)
  parser.add_argument("--period", type=int, default=None, help="checkpoint_period; default 5 (--quick: 3)")
  parser.add_argument("--steps", type=int, default=None, help="default 40 (--quick: 6)")
  parser.add_argument("--out", default="", help="keep each run's folder (checkpoints, metrics.jsonl) under this one")
  parser.add_argument("--quick", action="store_true", help="the short mode: see the module's docstring")
  args = parser.parse_args()
  defaults = (1, 3, 6) if args.quick else (2, 5, 40)
  given = (args.rounds, args.period, args.steps)
  rounds, period, steps = (d if g is None else g for g, d in zip(given, defaults, strict=True))
  for flag, value in (("--rounds", rounds), ("--period", period), ("--steps", steps)):
    if value < 1:
      fail(f"{flag} {value} is not a positive count; pass 1 or more")
  names = [f"round{r}_{name.replace(' ', '_')}" for r in range(rounds) for name in VARIANTS]
  taken = [n for n in names if args.out and os.path.exists(os.path.join(args.out, n))]
  if taken:  # A run folder with checkpoints in it would resume from them.
    fail(f"--out {args.out} already holds {taken[0]}; pass a new or empty folder")
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={args.devices}"}
  replaced = ("steps=", "enable_checkpointing=", *(f"{k}=" for k in QUICK if args.quick))
  config = [a for a in CONFIG if not a.startswith(replaced)] + [f"{k}={v}" for k, v in QUICK.items() if args.quick]
  results = {name: [] for name in VARIANTS}
  with tempfile.TemporaryDirectory() as scratch:
    cache = os.path.join(scratch, "jax_cache") if args.quick else ""  # Empty: no persistent compilation cache.
    for r in range(rounds):
      for name, extra in VARIANTS.items():
        out = os.path.join(os.path.abspath(args.out) if args.out else scratch, f"round{r}_{name.replace(' ', '_')}")
        cmd = [sys.executable, os.path.join(REPO, "MaxText", "train.py"), os.path.join(REPO, "MaxText/configs/base.yml")]
        cmd += [*config, f"steps={steps}", f"checkpoint_period={period}", "log_period=1", f"jax_cache_dir={cache}"]
        cmd += [*extra, f"run_name=overhead{r}", f"base_output_directory={out}", "enable_tensorboard=false"]
        cmd += ["log_config=false", *([f"metrics_file={os.path.join(out, 'metrics.jsonl')}"] if args.out else [])]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if proc.returncode:
          raise SystemExit(f"{name}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
        step = float(DONE.search(proc.stdout).group(1))
        fraction, wall, blocking = (float(x) for x in GOODPUT.search(proc.stdout).groups())
        results[name].append((step, fraction, wall, blocking))
        print(f"round {r} {name:>15}: median step {step:.3f} s, goodput {fraction:.1f}% of {wall:.1f} s, "
              f"checkpoints blocking {blocking:.2f} s", flush=True)  # fmt: skip
        if not args.out:
          shutil.rmtree(out)
  print(f"\nmedians over {rounds} rounds ({args.devices} device(s), a save every {period} steps of {steps}):")
  for name, runs in results.items():
    times, fractions, _, blocking = zip(*runs, strict=True)
    median = sorted(times)[len(times) // 2]
    print(f"  {name:>15}: step {median:.3f} s, goodput {sorted(fractions)[len(fractions) // 2]:.1f}%, "
          f"checkpoints blocking {sorted(blocking)[len(blocking) // 2]:.2f} s")  # fmt: skip


if __name__ == "__main__":
  main()
