"""Side-by-side CPU training benchmark of a tiny Mixtral-shaped model (8 experts, top-2, emb 256, 4 layers, seq
256): this framework vs the PyPI `maxtext` package, with the same keys.

    python3 end_to_end/benchmark_moe_cpu.py [--rounds 2] [--devices 1 2] [--python PATH] [--peer-python PATH]
    python3 end_to_end/benchmark_moe_cpu.py --quick [--metrics-file PATH]

Dropless routing (capacity_factor=-1, sparse_matmul=true); megablox=false because the peer's megablox kernel is
TPU-only (ours is used on TPU only as well). See end_to_end/side_by_side.py for what is run and printed, and
end_to_end/benchmark_cpu.py for --quick (the short mode: one round on one device, 8 steps of 1 x 128 tokens) and
--metrics-file.
"""

import benchmark_cpu
import side_by_side

if __name__ == "__main__":
  benchmark_cpu.main(side_by_side.MOE_CONFIG, " ".join(__doc__.split("\n\n")[0].split()))  # the first paragraph
