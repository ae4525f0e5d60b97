"""Side-by-side CPU training benchmark of the core issue's config: this framework vs the PyPI `maxtext` package.

    python3 end_to_end/benchmark_cpu.py [--rounds 2] [--devices 1 2] [--python PATH] [--peer-python PATH]

See end_to_end/side_by_side.py for what is run and printed.
"""

import side_by_side

if __name__ == "__main__":
  side_by_side.main(side_by_side.CORE_CONFIG, __doc__.splitlines()[0])
