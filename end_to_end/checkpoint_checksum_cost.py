"""What the checkpoint checksums cost: save and restore of a 1 GiB train state, with and without them.

  python3 end_to_end/checkpoint_checksum_cost.py [--gib 1] [--rounds 3] [--devices 1] [--dir /tmp/checksum_cost]

Saves are synchronous here (the time until the checkpoint is complete); in training the Orbax write runs in the
background, and what blocks the loop is the checksums (computed on the devices before the write starts) and
Orbax's copy of the state to host memory. Rounds
alternate the two variants so that drift of the machine's speed hits both.
"""

import argparse
import os
import shutil
import statistics
import sys
import time


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--gib", type=float, default=1.0, help="size of the state (float32 arrays)")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--devices", type=int, default=1, help="simulated CPU devices the state is sharded over")
  parser.add_argument("--dir", default="/tmp/checksum_cost", help="where the checkpoints are written (deleted after)")
  args = parser.parse_args()
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

  import jax
  import jax.numpy as jnp
  import orbax.checkpoint as ocp
  from jax.sharding import NamedSharding, PartitionSpec

  from MaxText import checkpointing, integrity
  from MaxText.state import TrainState

  mesh = jax.make_mesh((args.devices,), ("fsdp",))
  sharded = NamedSharding(mesh, PartitionSpec("fsdp"))
  rows = 4096 * args.devices
  leaves = max(1, round(args.gib * 2**30 / (rows * 4096 * 4)))
  make = jax.jit(lambda k: jax.random.normal(k, (rows, 4096), jnp.float32), out_shardings=sharded)
  params = {f"w{i}": make(jax.random.key(i)) for i in range(leaves)}
  state = TrainState(step=jnp.int32(1), params=params, opt_state={})
  size = sum(x.nbytes for x in jax.tree_util.tree_leaves(state))
  print(f"state: {leaves} float32 arrays, {size / 2**30:.2f} GiB, sharded over {args.devices} device(s)", flush=True)

  def manager(directory):
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False, create=True)
    return ocp.CheckpointManager(directory, options=options, item_names=checkpointing_items)

  checkpointing_items = (checkpointing.ITEM, checkpointing.CHECKSUM_ITEM)
  integrity.record(state)  # Compiles the checksum program once, as the first save of a run does.
  times = {k: [] for k in ("record", "save with", "save without", "restore", "verify")}
  for r in range(args.rounds):
    for with_checksums in (r % 2 == 0, r % 2 != 0):
      directory = os.path.join(args.dir, f"{r}-{with_checksums}")
      shutil.rmtree(directory, ignore_errors=True)
      with manager(directory) as m:
        start = time.perf_counter()
        if with_checksums:
          checkpointing.save(m, state)
        else:
          m.save(1, args=ocp.args.Composite(**{checkpointing.ITEM: ocp.args.StandardSave(state)}))
        m.wait_until_finished()
        times["save with" if with_checksums else "save without"].append(time.perf_counter() - start)
        if with_checksums:
          start = time.perf_counter()
          integrity.record(state)
          times["record"].append(time.perf_counter() - start)
          start = time.perf_counter()
          restored = m.restore(1, args=ocp.args.Composite(**{checkpointing.ITEM: ocp.args.StandardRestore(state)}))
          restored = jax.block_until_ready(restored[checkpointing.ITEM])
          times["restore"].append(time.perf_counter() - start)
          start = time.perf_counter()
          checkpointing.verify(os.path.join(directory, "1", checkpointing.ITEM), restored)
          times["verify"].append(time.perf_counter() - start)
      shutil.rmtree(directory)
  for name, values in times.items():
    print(f"{name:>13}: median {statistics.median(values):.3f} s  ({', '.join(f'{v:.3f}' for v in values)})")
  median = {name: statistics.median(values) for name, values in times.items()}
  print(
    f"checksums: {median['record'] / (size / 2**30):.3f} s per GiB to compute; save "
    f"{median['save with'] / median['save without']:.2f}x, restore + verify "
    f"{(median['restore'] + median['verify']) / median['restore']:.2f}x"
  )


if __name__ == "__main__":
  main()
