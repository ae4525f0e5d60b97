"""Training: `python3 MaxText/train.py MaxText/configs/base.yml run_name=NAME [key=value ...]`.

The loss, the train step and the loop, top to bottom. Set-up lives in pyconfig, sharding, state,
checkpointing, input_pipeline and metrics.
"""

import time

_PROCESS_START = time.time()

import concurrent.futures  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

if __package__ in (None, ""):  # Run as a script: make the `MaxText` package importable.
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
import yaml  # noqa: E402

from MaxText import checkpointing, distributed, input_pipeline, metrics, optimizers, pyconfig, sharding  # noqa: E402
from MaxText import state as state_lib  # noqa: E402
from MaxText.layers import models  # noqa: E402
from MaxText.pyconfig import Config, ConfigError  # noqa: E402

PLATFORMS = {"cpu": "cpu", "gpu": "cuda", "tpu": "tpu"}
CPU_YNN_FUSIONS = "LIBRARY_FUSION_TYPE_DOT,LIBRARY_FUSION_TYPE_REDUCE"  # See compiler_options().


# ---------------------------------------------------------------------------------------------- the math
def loss_fn(model, params, batch, dropout_rng, deterministic=False):
  """Summed token cross-entropy (float32) over non-padding targets, and the number of those targets.

  batch: inputs, inputs_segmentation, inputs_position, targets, targets_segmentation [batch, length].
  Returning the sum (not the mean) lets micro-batches add up to exactly the full batch's loss.
  """
  logits_BLV = model.apply(
    {"params": params},
    batch["inputs"],
    batch["inputs_segmentation"],
    batch["inputs_position"],
    deterministic=deterministic,
    rngs={"dropout": dropout_rng},
  ).astype(jnp.float32)
  xent_BL = optax.softmax_cross_entropy_with_integer_labels(logits_BLV, batch["targets"])
  mask_BL = batch["targets_segmentation"] != 0
  return jnp.sum(jnp.where(mask_BL, xent_BL, 0.0)), jnp.sum(mask_BL)


def train_step(model, config: Config, tx, schedule, state: state_lib.TrainState, batch):
  """One optimizer step over the global batch, split into gradient_accumulation_steps micro-batches.

  Gradients of the summed loss are added over micro-batches and divided once by the total number of
  target tokens, so k micro-batches of b rows give the same update as one batch of k*b rows.
  """
  dropout_rng = jax.random.fold_in(jax.random.key(config.init_weights_seed), state.step)
  grad_fn = jax.value_and_grad(lambda p, b, r: loss_fn(model, p, b, r), has_aux=True)
  k = config.gradient_accumulation_steps
  if k == 1:
    (loss_sum, num_tokens), grads = grad_fn(state.params, batch, dropout_rng)
  else:
    # Row r of the global batch goes to micro-batch r % k: each device keeps its own rows.
    micro = jax.tree_util.tree_map(lambda x: jnp.swapaxes(x.reshape(-1, k, *x.shape[1:]), 0, 1), batch)

    def accumulate(carry, i_and_batch):
      i, micro_batch = i_and_batch
      (loss_i, tokens_i), grads_i = grad_fn(state.params, micro_batch, jax.random.fold_in(dropout_rng, i))
      loss_sum, num_tokens, grads = carry
      grads = jax.tree_util.tree_map(lambda g, gi: g + gi.astype(jnp.float32), grads, grads_i)
      return (loss_sum + loss_i, num_tokens + tokens_i, grads), None

    zeros = jax.tree_util.tree_map(lambda p: jnp.zeros(p.shape, jnp.float32), state.params)
    init = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32), zeros)
    (loss_sum, num_tokens, grads), _ = jax.lax.scan(accumulate, init, (jnp.arange(k), micro))

  denominator = jnp.maximum(num_tokens, 1).astype(jnp.float32)
  grads = jax.tree_util.tree_map(lambda g, p: (g / denominator).astype(p.dtype), grads, state.params)
  updates, opt_state = tx.update(grads, state.opt_state, state.params)
  new_state = state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates), opt_state=opt_state)
  step_metrics = {
    "learning/loss": loss_sum / denominator,
    "learning/grad_norm": optax.tree.norm(grads),
    "learning/param_norm": optax.tree.norm(new_state.params),
    "learning/current_learning_rate": schedule(state.step),
    "learning/total_weights": num_tokens,
  }
  return new_state, step_metrics


def eval_step(model, params, batch):
  """(summed float32 cross-entropy, number of non-padding targets) of one eval batch, no dropout."""
  return loss_fn(model, params, batch, jax.random.key(0), deterministic=True)


def evaluate(config: Config, mesh, eval_fn, params) -> dict[str, float]:
  """Mean loss per non-padding target token over eval_steps batches (-1: one pass over the split)."""
  loss_sum, tokens = 0.0, 0
  batches = input_pipeline.create_eval_iterator(config, mesh)
  for i, batch in enumerate(batches):
    if i == config.eval_steps:
      break
    batch_loss, batch_tokens = jax.device_get(eval_fn(params, batch))
    loss_sum, tokens = loss_sum + float(batch_loss), tokens + int(batch_tokens)
  if tokens == 0:
    raise TrainingError(
      "the evaluation split gave no full batch; lower eval_per_device_batch_size or give more eval documents"
    )
  avg = loss_sum / tokens
  return {"eval/avg_loss": avg, "eval/perplexity": math.exp(min(avg, 700.0)), "eval/total_weights": tokens}


# ---------------------------------------------------------------------------------------------- set-up
def configure_jax(values) -> None:
  """Platform and persistent compilation cache; must run before the first device query."""
  if "JAX_PLATFORMS" not in os.environ:
    jax.config.update("jax_platforms", PLATFORMS[values["hardware"]])
  if values["jax_cache_dir"]:
    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(values["jax_cache_dir"]))
    # Cache every executable: on small models compilation, not execution, dominates start-up.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def compiler_options(mesh: jax.sharding.Mesh) -> dict[str, str]:
  """XLA options for compiling the train step: a measured CPU tuning, nothing on GPU or TPU.

  On CPU with jax >= 0.11, when each device of this process has two or more cores, restricting XLA's
  YNNPACK fusions to dots and reductions ran the core benchmark step 1.6x faster on one device of a 2-core
  machine (docs/PERFORMANCE.md); with one core per device, and on jax 0.10, XLA's default was fastest.
  A ynn setting in XLA_FLAGS wins over this one.
  """
  devices = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
  cores_per_device = (os.cpu_count() or 1) // max(len(devices), 1)
  if (
    devices[0].platform != "cpu"
    or jax.__version_info__ < (0, 11)
    or cores_per_device < 2
    or "xla_cpu_experimental_ynn_fusion_type" in os.environ.get("XLA_FLAGS", "")
  ):
    return {}
  return {"xla_cpu_experimental_ynn_fusion_type": CPU_YNN_FUSIONS}


def load_config(argv) -> Config:
  values = pyconfig.parse(argv)
  configure_jax(values)
  distributed.initialize(values)  # A multi-process job is joined before the first device query.
  try:
    devices = jax.devices()
  except RuntimeError as e:
    raise ConfigError(
      f"hardware={values['hardware']}: no such JAX backend here ({str(e).splitlines()[0][:120]}); "
      "install its jaxlib (setup.sh DEVICE=gpu) or set hardware=cpu"
    ) from None
  return pyconfig.finalize(values, num_devices=len(devices), num_slices=sharding.count_slices(devices))


def write_resolved_config(config: Config, directory: str) -> None:
  if jax.process_index() == 0:
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.yml"), "w", encoding="utf-8") as f:
      yaml.safe_dump(config.as_dict(), f, sort_keys=True)


class TrainingError(RuntimeError):
  """Training cannot go on (e.g. the loss is NaN); the message says why and what to try."""


# ---------------------------------------------------------------------------------------------- the loop
def train(config: Config, devices=None) -> dict:
  """Runs the training loop on `devices` (default: all); returns a summary (losses, step times, ...)."""
  mesh = sharding.create_mesh(config, devices)
  missing = sharding.missing_rules(config)
  if missing:
    raise ConfigError(f"logical_axis_rules has no rule for {missing}; add [name, [mesh axes]] entries for them")
  model = models.Transformer(config, mesh)
  schedule = optimizers.learning_rate_schedule(config)
  tx = optimizers.create_optimizer(config, schedule)
  layout = state_lib.state_layout(model, config, tx, mesh)
  checkpointing.check_start_paths(config, layout)  # Before anything is written.
  input_pipeline.check(config)
  checkpointing.check_shared_run_dir(config)

  run_dir = checkpointing.run_dir(config)
  manager = checkpointing.create_manager(config)
  try:
    return _train_loop(config, mesh, model, schedule, tx, layout, manager, run_dir)
  finally:
    if manager is not None:
      manager.wait_until_finished()
      manager.close()


def _train_loop(config, mesh, model, schedule, tx, layout, manager, run_dir) -> dict:
  """The loop proper: restore or init, then step, log and checkpoint until `steps`."""
  batch_sharding = sharding.batch_sharding(mesh, config)
  step_fn = jax.jit(
    lambda s, b: train_step(model, config, tx, schedule, s, b),
    in_shardings=(layout.shardings, batch_sharding),
    out_shardings=(layout.shardings, sharding.logical_sharding((), mesh, config)),
    donate_argnums=(0,),
  )
  # Compile the step ahead of time in the background while the state is restored or initialised.
  batch_shape = jax.ShapeDtypeStruct(
    (config.global_batch_size, config.max_target_length), jnp.int32, sharding=batch_sharding
  )
  abstract_batch = dict.fromkeys(input_pipeline.BATCH_KEYS, batch_shape)
  options = compiler_options(mesh)
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    lowered = step_fn.lower(layout.abstract, abstract_batch)  # Tracing holds the GIL: do it first, here.
    compiling = pool.submit(lambda: lowered.compile(options))
    start = checkpointing.restore_or_init(config, manager, model, tx, layout)
    state = start.state
    first_step = int(jax.device_get(state.step))
    num_params = metrics.count_params(layout.abstract.params)
    write_resolved_config(config, run_dir)
    log(f"Model: {num_params / 1e6:.2f}M parameters; mesh {dict(mesh.shape)}; starting from {start.source}")
    if first_step >= config.steps:
      log(f"Nothing to do: the run is already at step {first_step} of steps={config.steps}.")
      return {"steps_run": 0}
    data = input_pipeline.create_iterator(config, mesh, start_step=first_step)
    if start.resumed and config.dataset_type != "synthetic":
      checkpointing.restore_data(config, manager, first_step, data)
    compiled_step = compiling.result()
  writer = metrics.MetricWriter(config, run_dir)

  flops = metrics.training_flops_per_device(config)
  peak = metrics.peak_tflops(mesh.devices.flat[0].device_kind, config.cpu_peak_tflops)
  tokens_per_device = config.global_batch_size * config.max_target_length / config.num_devices
  eval_fn = jax.jit(
    lambda p, b: eval_step(model, p, b),
    in_shardings=(layout.shardings.params, batch_sharding),
    out_shardings=sharding.logical_sharding((), mesh, config),
  )
  profile_start = config.skip_first_n_steps_for_profiler
  profile_stop = profile_start + config.profiler_steps

  # JAX's preemption service (SIGTERM -> a step every process stops at) runs only in a multi-process job.
  watch_preemption = manager is not None and jax.distributed.is_initialized()
  step_times, losses = [], []
  last_time, last_step = time.time(), first_step
  summary = {"first_step": first_step}
  try:
    for step in range(first_step, config.steps):
      if config.profiler == "xplane" and step == profile_start:
        jax.profiler.start_trace(os.path.join(run_dir, "tensorboard"))
      state, step_metrics = compiled_step(state, next(data))
      completed = step + 1
      if config.profiler == "xplane" and completed == profile_stop:
        jax.block_until_ready(state)
        jax.profiler.stop_trace()
      # SIGTERM (a preemption or maintenance notice) to any process: every process stops at the same step, saves.
      preempted = watch_preemption and manager.reached_preemption(completed)
      save_now = manager is not None and (
        completed % config.checkpoint_period == 0 or completed == config.steps or preempted
      )
      eval_now = config.eval_interval > 0 and (completed % config.eval_interval == 0 or completed == config.steps)
      if completed % config.log_period and not (save_now or eval_now) and completed != config.steps and step != first_step:
        continue  # The first step is always measured: it gives the time to first step.
      scalars = {k: float(v) for k, v in jax.device_get(step_metrics).items()}
      now = time.time()
      step_time = (now - last_time) / (completed - last_step)
      if step == first_step:
        summary["time_to_first_step"] = now - _PROCESS_START
      else:
        step_times.extend([step_time] * (completed - last_step))
      last_time, last_step = now, completed
      loss = scalars["learning/loss"]
      # The loss is that of the params before this step; the updated params (about to be saved) are
      # checked through their norm, so a non-finite state is never checkpointed.
      if not (math.isfinite(loss) and math.isfinite(scalars["learning/param_norm"])):
        latest = manager.latest_step() if manager is not None else None
        raise TrainingError(
          f"loss={loss}, param_norm={scalars['learning/param_norm']} after step {step}; lower learning_rate "
          f"(now {config.learning_rate}) or set gradient_clipping_threshold; last good checkpoint: {latest}"
        )
      losses.append((step, loss))
      achieved = flops.total / step_time / 1e12
      scalars.update(
        {
          "perf/step_time_seconds": step_time,
          "perf/per_device_tflops_per_sec": achieved,
          "perf/per_device_tokens_per_sec": tokens_per_device / step_time,
          "perf/mfu": None if peak is None else achieved / peak,
        }
      )
      log(metrics.format_step(step, scalars))
      writer.write(step, scalars)
      if eval_now:
        eval_scalars = evaluate(config, mesh, eval_fn, state.params)
        log(
          f"eval after step {step}: loss {eval_scalars['eval/avg_loss']:.4f}, perplexity "
          f"{eval_scalars['eval/perplexity']:.2f} over {eval_scalars['eval/total_weights']} tokens"
        )
        writer.write(step, eval_scalars)
        summary["eval"] = eval_scalars
        last_time = time.time()  # Evaluation time is not step time.
      data_state = None if config.dataset_type == "synthetic" or not save_now else data.get_state()
      if save_now and checkpointing.save(manager, state, data_state):
        log(f"saving checkpoint {completed} to {checkpointing.checkpoint_dir(config)}")
      if preempted and completed < config.steps:
        manager.wait_until_finished()
        raise TrainingError(
          f"preempted (SIGTERM) after step {step}; checkpoint {completed} is saved: run the same command again to resume"
        )
  finally:
    writer.close()

  memory, memory_kind = metrics.peak_memory_bytes()
  steps_run = config.steps - first_step
  summary.update(
    {
      "steps_run": steps_run,
      "losses": losses,
      "total_tokens": steps_run * config.global_batch_size * config.max_target_length,
      "median_step_time": metrics.median(step_times),
      "peak_memory_bytes": memory,
    }
  )
  log(
    f"Done: {summary['total_tokens']} tokens in {steps_run} steps; median step time "
    f"{summary['median_step_time']:.3f} s (steps after the first); peak memory {memory / 2**30:.2f} GiB "
    f"({memory_kind}); time to first step {summary['time_to_first_step']:.1f} s"
  )
  return summary


def log(message: str) -> None:
  if jax.process_index() == 0:
    print(message, flush=True)


def run_cli(body, argv) -> int:
  """A script's exit code: runs body(config) for the command line `argv` (an int it returns is the exit code,
  anything else means 0); a user mistake (ConfigError, exit 2) or a failed run (TrainingError, exit 1) is one
  line on stderr instead of a traceback.

  In a multi-process job a failing process leaves at once, without JAX's shutdown barrier (which would wait
  for the other processes while they wait for it in a collective): they see it gone and fail too.
  """
  logging.getLogger("absl").setLevel(logging.ERROR)  # Orbax's per-save chatter would bury our log.
  try:
    code = body(load_config(argv[1:]))
    code = code if isinstance(code, int) else 0
  except ConfigError as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    code = 2
  except TrainingError as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    code = 1
  except Exception:
    if not jax.distributed.is_initialized():
      raise
    traceback.print_exc()
    code = 1
  if code and jax.distributed.is_initialized():
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
  return code


def _train_cli(config: Config) -> None:
  if config.log_config:
    log("Config: " + " ".join(f"{k}={v}" for k, v in sorted(config.as_dict().items()) if k != "logical_axis_rules"))
  train(config)


def main(argv) -> int:
  return run_cli(_train_cli, argv)


if __name__ == "__main__":
  sys.exit(main(sys.argv))
