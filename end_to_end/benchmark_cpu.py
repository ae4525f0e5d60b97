"""Side-by-side CPU training benchmark of the core issue's config: this framework vs the PyPI `maxtext` package.

    python3 end_to_end/benchmark_cpu.py [--rounds 2] [--devices 1 2] [--python PATH] [--peer-python PATH]
    python3 end_to_end/benchmark_cpu.py --quick [--metrics-file PATH]

See end_to_end/side_by_side.py for what is run and printed. Two options of these scripts come on top of its own:
--quick, the short mode (about 30 s on 2 CPU cores for ours alone), is one round on one device of 8 steps of batch
1 x 128 tokens (the same model; the tokens/s median is then over steps 5-7); --metrics-file PATH passes
metrics_file=PATH to every training run, which appends its step records and its goodput line there in the order run
(per round: ours cold, ours warm, then the peer's if installed).
"""

import argparse
import os
import sys

import side_by_side

QUICK = {"steps": "8", "per_device_batch_size": "1", "max_target_length": "128"}


def main(config: list[str], description: str) -> None:
  """side_by_side.main on `config` (key=value arguments), after taking --quick and --metrics-file off the command line:
  they replace keys of `config`, and --quick makes one round on one device the default."""
  parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--metrics-file", default="")
  args, rest = parser.parse_known_args()
  keys = dict(QUICK) if args.quick else {}
  if args.metrics_file:  # Absolute: the peer runs in another folder.
    keys["metrics_file"] = os.path.abspath(args.metrics_file)
  config = [a for a in config if a.split("=")[0] not in keys] + [f"{k}={v}" for k, v in keys.items()]
  # Given first, so that a --rounds or --devices of the command line still wins (argparse keeps the last).
  sys.argv = [sys.argv[0], *(["--rounds", "1", "--devices", "1"] if args.quick else []), *rest]
  more = " Also --quick (1 round, 1 device, 8 steps of 1 x 128 tokens) and --metrics-file PATH (every run's metrics_file)."
  side_by_side.main(config, description + more)


if __name__ == "__main__":
  main(side_by_side.CORE_CONFIG, __doc__.splitlines()[0])
