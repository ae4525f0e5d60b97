"""The side-by-side CPU training benchmark behind benchmark_cpu.py and benchmark_moe_cpu.py: one config run by this
framework and by the PyPI `maxtext` package (../shared/bench/peer_maxtext.sh install), alternating (A B A B)
because the machine is noisy, each with a fresh (cold) compilation cache, on N simulated CPU devices (N=2 adds
ici_fsdp_parallelism=2). Per framework and device count it prints:
  - tokens/s (all devices): median over steps 5-19 of the logged Tokens/s/device, times N;
  - time to first step: from process launch to the line of step 0 (stdout is streamed and timed here);
  - for ours also a second run on the same cache (warm persistent compilation cache).
The peer is launched with the same arguments as peer_maxtext.sh. --python runs ours under another interpreter,
e.g. a Python 3.12 environment made with `PYTHON=python3.12 bash setup.sh`, to compare on the peer's own stack.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The core issue's benchmark model (benchmark_cpu.py).
CORE_CONFIG = (
  "base_emb_dim=256 base_num_query_heads=4 base_num_kv_heads=4 base_mlp_dim=1024 base_num_decoder_layers=4 "
  "head_dim=64 vocab_size=32000 max_target_length=256 per_device_batch_size=4 dataset_type=synthetic steps=20 "
  "enable_checkpointing=false remat_policy=full scan_layers=true"
).split()
# A tiny Mixtral-shaped model (benchmark_moe_cpu.py): megablox=false, the peer's megablox kernel being TPU-only.
MOE_CONFIG = (
  "decoder_block=mixtral num_experts=8 num_experts_per_tok=2 base_emb_dim=256 base_num_query_heads=4 "
  "base_num_kv_heads=4 base_mlp_dim=1024 base_moe_mlp_dim=1024 base_num_decoder_layers=4 head_dim=64 vocab_size=32000 "
  "max_target_length=256 per_device_batch_size=4 dataset_type=synthetic steps=20 enable_checkpointing=false "
  "remat_policy=full scan_layers=true sparse_matmul=true megablox=false capacity_factor=-1"
).split()
STEP_LINE = re.compile(r"completed step: (\d+), seconds: ([\d.]+), .*Tokens/s/device: ([\d.]+)")


def run(cmd, env, cwd):
  """Runs cmd, timing each stdout line from launch; returns (time to step 0, {step: tokens/s/device})."""
  launch = time.time()
  proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  first, rates, tail = None, {}, []
  for line in proc.stdout:
    tail = (tail + [line])[-20:]
    match = STEP_LINE.search(line)
    if match:
      step = int(match.group(1))
      first = time.time() - launch if step == 0 and first is None else first
      rates[step] = float(match.group(3))
  if proc.wait() != 0 or first is None:
    sys.exit(f"benchmark run failed: {' '.join(cmd)}\n{''.join(tail)}")
  return first, rates


def ours(config, devices, cache, out, python):
  extra = ["ici_fsdp_parallelism=2"] if devices == 2 else []
  cmd = [
    python,
    "MaxText/train.py",
    "MaxText/configs/base.yml",
    "run_name=bench",
    f"base_output_directory={out}",
    f"jax_cache_dir={cache}",
    "log_config=false",
    *config,
    *extra,
  ]
  return cmd, REPO


def peer(config, devices, cache, out, python):
  import_dir = subprocess.check_output(
    [python, "-c", "import maxtext,os;print(os.path.dirname(maxtext.__file__))"], text=True
  )
  extra = ["ici_fsdp_parallelism=2"] if devices == 2 else []
  cmd = [
    python,
    "-m",
    "maxtext.trainers.pre_train.train",
    f"{import_dir.strip()}/configs/base.yml",
    "hardware=cpu",
    "skip_jax_distributed_system=true",
    "log_config=false",
    f"base_output_directory={out}",
    f"jax_cache_dir={cache}",
    "run_name=peer",
    *config,
    *extra,
  ]
  return cmd, tempfile.gettempdir()


def main(config, description):
  """Parses the command line and runs the alternating comparison of `config` (key=value arguments)."""
  parser = argparse.ArgumentParser(description=description)
  parser.add_argument("--rounds", type=int, default=2)
  parser.add_argument("--devices", type=int, nargs="+", default=[1, 2])
  parser.add_argument("--python", default=sys.executable, help="interpreter for ours (default: this one)")
  parser.add_argument("--peer-python", default=os.path.expanduser("~/.cache/peer-maxtext/bin/python"))
  args = parser.parse_args()
  has_peer = os.path.exists(args.peer_python)
  if not has_peer:
    print(f"peer not installed at {args.peer_python}: run ../shared/bench/peer_maxtext.sh install; ours only")
  version = subprocess.check_output([args.python, "-c", "import sys, jax; print(sys.version.split()[0], jax.__version__)"])
  print(f"ours: {args.python} (Python, jax: {version.decode().strip()})")
  results = {}
  for devices in args.devices:
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu"}
    for _ in range(args.rounds):
      sides = [("ours", args.python)] + ([("maxtext", args.peer_python)] if has_peer else [])
      for name, python in sides:
        with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as out:
          side = ours if name == "ours" else peer
          cmd, cwd = side(config, devices, cache, out, python)
          first, rates = run(cmd, env, cwd)
          results.setdefault((name, devices, "cold"), []).append((first, rates))
          if name == "ours":  # Same command again on the now warm persistent cache.
            results.setdefault((name, devices, "warm"), []).append(run(cmd, env, cwd))
  print(f"{'framework':<10}{'devices':>8}{'cache':>7}{'tokens/s (all devices)':>26}{'time to first step (s)':>26}")
  for (name, devices, cache), runs in sorted(results.items()):
    tokens = statistics.median(r[s] for _, r in runs for s in range(5, 20) if s in r) * devices
    first = statistics.median(f for f, _ in runs)
    print(f"{name:<10}{devices:>8}{cache:>7}{tokens:>26.0f}{first:>26.1f}")
