"""Every test runs on the CPU with 8 simulated devices, so each parallelism axis is exercised for real.

The tests compile the same small programs in many places and on every run, so this process keeps them in a
persistent compilation cache of the tests' own (not the user's ~/jax_cache): every run after the first on a
machine is about twice as fast. It holds about 15 MB after a whole run and only grows as programs change; delete
~/.cache/maxtext_tests to start afresh. The configs of the tests say jax_cache_dir= (helpers.TINY), so neither the
command-line path in this process nor the processes the tests start use any other cache.
"""

import os

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402  (after XLA_FLAGS: the device count is read when jax starts)

jax.config.update("jax_compilation_cache_dir", os.path.join(os.path.expanduser("~"), ".cache", "maxtext_tests", "jax"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
