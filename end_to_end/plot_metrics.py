"""Plots the train and eval loss of a metrics_file (one JSON object per line) into a PNG.

python3 end_to_end/plot_metrics.py METRICS_FILE OUTPUT.png [--title TEXT]
"""

import argparse
import json
import sys


def read(path: str) -> tuple[list, list]:
  """(train [(step, loss)], eval [(step, avg_loss)]) of a metrics file; the last record of a step wins."""
  train, evals = {}, {}
  with open(path, encoding="utf-8") as f:
    for line in f:
      record = json.loads(line)
      if "learning/loss" in record:
        train[record["step"]] = record["learning/loss"]
      if "eval/avg_loss" in record:
        evals[record["step"]] = record["eval/avg_loss"]
  return sorted(train.items()), sorted(evals.items())


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("metrics_file")
  parser.add_argument("output")
  parser.add_argument("--title", default="")
  args = parser.parse_args(argv)
  train, evals = read(args.metrics_file)
  if not train:
    print(f"error: {args.metrics_file} has no learning/loss records", file=sys.stderr)
    return 2
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
  ax.plot(*zip(*train, strict=True), label="train loss", linewidth=1)
  if evals:
    ax.plot(*zip(*evals, strict=True), "o-", label="eval loss")
  ax.set_xlabel("step")
  ax.set_ylabel("cross-entropy (nats per token)")
  ax.set_title(args.title or args.metrics_file)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(args.output)
  print(f"wrote {args.output}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
