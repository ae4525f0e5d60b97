"""Training: `python3 MaxText/train.py MaxText/configs/base.yml run_name=NAME [key=value ...]`.

The loop, top to bottom: build the run, step, log, evaluate, save. The step's math and its compilation live in
step.py; what differs between pre-training, SFT, DPO and RL (the data, the loss, the evaluation) in the training
objective (MaxText/objectives/); set-up in cli, pyconfig, sharding, state, checkpointing (with its full-disk policy)
and metrics.
"""

import contextlib
import dataclasses
import functools
import math
import sys
import time
import types
from collections.abc import Callable
from typing import Any

if __package__ in (None, ""):  # Run as a script: see MaxText/script_path.py.
  import script_path  # noqa: F401

import jax
import optax
import yaml

from MaxText import checkpointing, cli, compiled_step, config_derive, metrics, objectives, optimizers, pyconfig, storage
from MaxText import state as state_lib
from MaxText import step as step_lib
from MaxText.common_types import Config, ConfigError, TrainingError
from MaxText.layers import pipeline
from MaxText.objectives import base as objective_lib


@dataclasses.dataclass
class TrainSummary:
  """What train() did."""

  first_step: int  # the step it started from: 0, or that of the checkpoint it resumed
  steps_run: int = 0
  losses: list[tuple[int, float]] = dataclasses.field(default_factory=list)  # (step, loss) of each logged step
  last_eval: dict[str, float] | None = None  # the last evaluation's scalars
  first_eval: dict[str, float] | None = None  # the evaluation before the first step (an objective's evaluates_first)
  time_to_first_step: float | None = None  # seconds from the run's start (train() or main() called) to the first step's end
  median_step_time: float = math.nan  # seconds, over the steps after the first
  total_tokens: int = 0  # tokens of the steps run (global batch x max_target_length each)
  peak_memory_bytes: int = 0
  goodput: dict[str, float] = dataclasses.field(default_factory=dict)  # metrics.Goodput.report()


@dataclasses.dataclass(frozen=True)
class Cadence:
  """After which completed steps the loop logs, evaluates and saves."""

  config: Config
  first_step: int
  checkpointing: bool

  def log(self, completed: int) -> bool:
    """Every log_period steps, the last step, and the first (which gives the time to first step)."""
    return completed % self.config.log_period == 0 or completed in (self.config.steps, self.first_step + 1)

  def evaluate(self, completed: int) -> bool:
    interval = self.config.eval_interval
    return interval > 0 and (completed % interval == 0 or completed == self.config.steps)

  def save(self, completed: int, preempted: bool) -> bool:
    period = self.config.checkpoint_period
    return self.checkpointing and (completed % period == 0 or completed == self.config.steps or preempted)

  def between_rollouts(self, completed: int) -> bool:
    """Whether `completed` steps end a batch of rollouts (RL's num_iterations updates; always without RL): only then
    can a run stop and resume, since a batch's rollouts are made from the parameters at its first step."""
    return completed % self.config.num_iterations == 0


@dataclasses.dataclass(frozen=True)
class Run:
  """A run ready to step: the compiled step, the state it starts from, and the data positioned for it."""

  config: Config
  objective: objective_lib.Objective
  mesh: jax.sharding.Mesh
  manager: Any  # orbax.checkpoint.CheckpointManager (imported lazily), or None when enable_checkpointing=false
  step: jax.stages.Compiled  # (state, batch) -> (state, metrics)
  eval_fn: Callable  # jitted (params, reference params, batch) -> (loss sum, weight, {metric: sum})
  state: state_lib.TrainState
  first_step: int
  started: float  # time.time() when the run started: goodput's start-up and the time to first step count from it
  data: objective_lib.Batches | None = None  # the objective's training data; None when there is nothing left to do
  resumed: bool = False  # from the run's own checkpoint

  @property
  def run_dir(self) -> str:
    return checkpointing.run_dir(self.config)


def train(config: Config, devices=None, started: float | None = None) -> TrainSummary:
  """Runs the training loop on `devices` (default: all); returns what it did. started: time.time() when the
  command started (main() passes its own); by default now, so each call in a process counts its own time."""
  started = time.time() if started is None else started
  checkpointing.run_dir(config)  # An empty run_name is refused before any work.
  parts = step_lib.build(config, devices)
  state_bytes = compiled_step.state_bytes_per_device(parts.layout.abstract)
  compiled_step.check_fits("the train state (params and optimizer)", state_bytes, config, parts.mesh, step=False)
  checkpointing.check_start_paths(config, parts.layout)  # Before anything is written.
  objectives.get(config).check_start()
  checkpointing.check_shared_run_dir(config)

  manager = checkpointing.create_manager(config)
  try:
    with checkpointing.full_disk_stops_the_run(config, parts.layout):
      run = _prepare(config, manager, parts, started)
      if run.data is None:
        cli.log(f"Nothing to do: the run is already at step {run.first_step} of steps={config.steps}.")
        return TrainSummary(first_step=run.first_step)
      return _loop(run)
  finally:
    if manager is not None:
      manager.close()


def _prepare(config: Config, manager, parts: step_lib.Parts, started: float) -> Run:
  """Compiles the step ahead of time (or loads the one train_compile.py wrote to compiled_trainstep_file) while
  the state is restored or initialised, then positions the data for the first step. Nothing is written before
  the compiled step is known to fit in memory."""
  mesh, model, schedule, tx, layout = parts
  objective = objectives.get(config)
  jitted = step_lib.jit_train_step(config, mesh, model=model, schedule=schedule, tx=tx, layout=layout)
  compiled, start = step_lib.compile_while(
    config, mesh, jitted, lambda: checkpointing.restore_or_init(config, manager, model, tx, layout)
  )
  first_step = int(jax.device_get(start.state.step))
  data = None
  if first_step < config.steps:
    data = objective.data(mesh, start.state.params, first_step)
    if start.resumed and config.dataset_type != "synthetic":
      checkpointing.restore_data(config, manager, first_step, data)
  for damaged in start.skipped:
    cli.log(f"skipped: {damaged}")
  if start.resumed:
    warning = _schedule_change(config, schedule, first_step)
    if warning:
      cli.log(warning)
  cli.write_resolved_config(config, checkpointing.run_dir(config))
  num_params = metrics.count_params(layout.abstract.params)
  origin = start.source if start.resumed else f"starting from {start.source}"
  cli.log(f"Model: {num_params / 1e6:.2f}M parameters; mesh {dict(mesh.shape)}; {origin}")
  if pipeline.num_stages(config) > 1:
    cli.log(pipeline.describe(config))
  return Run(
    config=config,
    objective=objective,
    mesh=mesh,
    manager=manager,
    step=compiled,
    eval_fn=step_lib.jit_eval_step(config, mesh, model, layout),
    state=start.state,
    first_step=first_step,
    started=started,
    data=data,
    resumed=start.resumed,
  )


def _schedule_change(config: Config, schedule: optax.Schedule, first_step: int) -> str | None:
  """A warning line when a resumed run's learning-rate schedule differs from the one it last ran with (the run's
  config.yml, written at each start): extending `steps` stretches the schedule, so the rate jumps."""
  path = storage.join(checkpointing.run_dir(config), "config.yml")
  read = (*optimizers.SCHEDULE_KEYS, "warmup_steps")
  try:
    earlier = yaml.safe_load(storage.read_text(path)) if storage.isfile(path) else None
    # config.yml holds the keys as given (learning_rate_schedule_steps=-1 follows steps): resolved as they were.
    earlier = {**earlier, **config_derive.schedule(earlier)}
  except (OSError, yaml.YAMLError, TypeError, ValueError, KeyError):  # None, or not a config.yml of ours
    return None
  if any(key not in earlier for key in read):
    return None
  changed = [key for key in optimizers.SCHEDULE_KEYS if earlier[key] != getattr(config, key)]
  if not changed:
    return None
  # The earlier schedule as this run would follow it (with its steps): what passing the earlier values gives.
  before = optimizers.learning_rate_schedule(
    types.SimpleNamespace(**{key: earlier[key] for key in read}, steps=config.steps)
  )
  last = first_step - 1
  return (
    f"warning: the learning-rate schedule differs from this run's last start "
    f"({', '.join(f'{key} {earlier[key]} -> {getattr(config, key)}' for key in changed)}): the rate was "
    f"{float(before(last)):.3e} at step {last} and is now {float(schedule(first_step)):.3e} at step {first_step}, "
    f"where the earlier schedule gives {float(before(first_step)):.3e}; to keep the earlier schedule, pass "
    f"{' '.join(f'{key}={earlier[key]}' for key in changed)}"
  )


def _loop(run: Run) -> TrainSummary:
  """Steps from run.first_step to config.steps; logs, evaluates and saves when Cadence says."""
  config, manager, state = run.config, run.manager, run.state
  cadence = Cadence(config, run.first_step, checkpointing=manager is not None)
  profiler = metrics.Profiler(config, storage.join(run.run_dir, "tensorboard"))
  goodput = metrics.Goodput(run.started)
  if run.resumed:
    earlier = config.metrics_file or (metrics.metrics_path(run.run_dir) if config.gcs_metrics else "")
    goodput.read_earlier_metrics(earlier, run.first_step)
  writer = metrics.MetricWriter(config, run.run_dir)
  clock = metrics.StepClock(  # Last.
    config,
    run.mesh.devices.flat[0].device_kind,
    run.first_step,
    run.started,
    flops=run.objective.flops(),
    sequences_per_row=run.objective.sequences_per_row,
  )
  summary = TrainSummary(first_step=run.first_step)
  batch, completed = None, run.first_step
  stop = cli.StopRequest()
  failed = True
  sync_preemption = False  # a multi-process job's agreed step to stop at came, inside a batch of rollouts (RL)
  try:
    if run.objective.evaluates_first and run.first_step == 0 and config.eval_interval > 0:
      with goodput.waiting("evaluation"):
        summary.first_eval = _evaluate_and_log(run, state, -1, writer)
      clock.pause_until_now()
    for step in range(run.first_step, config.steps):
      profiler.before_step(step)
      # reuse_example_batch: benchmark on one batch; RL: num_iterations updates on each batch of rollouts.
      if batch is None or (config.reuse_example_batch <= 0 and cadence.between_rollouts(step)):
        with goodput.waiting("data"):
          batch = _next_batch(run, stop, state, completed)
      state, step_metrics = run.step(state, batch)
      completed = step + 1
      if manager is not None:
        manager.check_for_errors()  # A background save that failed (a full disk) stops the run now.
      profiler.after_step(completed, state)
      sync_preemption = sync_preemption or checkpointing.reached_preemption(manager, completed)
      signal_name = "SIGTERM" if sync_preemption else stop.signal_name
      preempted = signal_name is not None and cadence.between_rollouts(completed)  # RL: at the batch's end
      save, evaluate = cadence.save(completed, preempted), cadence.evaluate(completed)
      if not (save or evaluate or preempted or cadence.log(completed)):
        continue
      laps_from = clock.last_step
      scalars = {k: float(v) for k, v in jax.device_get(step_metrics).items()} | clock.lap(completed)
      steps = completed - laps_from  # The data's own figures (RL: its rollouts'), of the lap's time and steps.
      scalars |= run.data.metrics(scalars["perf/step_time_seconds"] * steps, steps)
      _log(run, step, scalars, summary, writer)
      if evaluate:
        with goodput.waiting("evaluation"):
          summary.last_eval = _evaluate_and_log(run, state, step, writer)
      if save:
        with goodput.waiting("checkpoint"):
          _save(run, state, completed)
      if evaluate or save:
        clock.pause_until_now()  # Evaluation, and the part of a save that blocks the loop, are not step time.
      if preempted and completed < config.steps:
        raise TrainingError(_stopped(signal_name, step, completed, manager))
    failed = False
  finally:
    stop.restore()
    _close(run, goodput, writer, summary, completed, failed)
  return _finish(summary, config, clock)


def _next_batch(run: Run, stop: cli.StopRequest, state: state_lib.TrainState, completed: int) -> dict:
  """The next training batch. A wait for data may never end by itself (a stalled bucket or data loader), so a
  SIGTERM or SIGINT during it stops the run there; data that runs out (a finite num_epoch) stops it too. Either
  way the steps completed since the last save are saved, with the data position from before the wait, and the
  run exits with one line. In a multi-process job nothing is saved here: the other processes are in the step's
  collectives, not in a save (and signals are JAX's preemption service's, see cli.StopRequest).

  RL: the wait is rollouts and rewards. A signal during it wins over whatever else it ended in: a reward's error
  (the signal's exception, raised in a built-in reward on this thread, can come out as one), or a batch made anyway
  (math-verify's parser catches every Exception, the signal's too, and scores the text 0). The step's batch is then
  dropped: the last completed step's state is saved with the prompts' position from before it, so the resumed run
  regenerates it bit for bit (its seeds are the step's). A KeyboardInterrupt that a reward function raises (not a
  second Ctrl-C, which stops at once) is an interrupt too."""
  saves = run.manager is not None and completed > run.first_step and jax.process_count() == 1
  position = run.data.get_state() if saves and run.config.dataset_type != "synthetic" else None
  try:
    with stop.interrupting():
      batch = run.data.batch(state.params, completed)
      if batch is None:
        raise StopIteration
      if stop.signal_name is not None:  # A signal whose exception the data's code caught.
        raise cli.StopRequest.Interrupted(stop.signal_name)
      return batch
  except ConfigError as e:  # RL: a reward function's mistake, or prompts that fit no more, met mid-run
    if stop.signal_name is None:
      if not saves:
        raise
      _save(run, state, completed, position)
      run.manager.wait_until_finished()
      raise ConfigError(f"{e}; checkpoint {completed} is saved: fix it and run the same command to resume") from None
    why, fix = _interrupted(stop.signal_name, completed)
  except cli.StopRequest.Interrupted:
    why, fix = _interrupted(stop.signal_name, completed)
  except KeyboardInterrupt:
    if stop.signal_name is not None:  # A second Ctrl-C: stop at once.
      raise
    why, fix = _interrupted("SIGINT", completed)
  except StopIteration:
    why = f"the training data ran out before step {completed} (num_epoch={run.config.num_epoch})"
    fix = "raise num_epoch or lower steps, then run again"
  if saves:
    _save(run, state, completed, position)
    run.manager.wait_until_finished()
    raise TrainingError(f"{why}; checkpoint {completed} is saved: {fix} to resume")
  latest = run.manager.latest_step() if run.manager is not None else None
  if latest is None:
    raise TrainingError(f"{why}; no checkpoint is saved: {fix}")
  raise TrainingError(f"{why}; checkpoint {latest} is the latest: {fix} to resume from it")


def _interrupted(signal_name: str, completed: int) -> tuple[str, str]:
  """(why, fix) of a run stopped by `signal_name` while it waited for the data of step `completed`."""
  what = "preempted" if signal_name == "SIGTERM" else "interrupted"
  return f"{what} ({signal_name}) while waiting for the data of step {completed}", "run the same command again"


def _log(run: Run, step: int, scalars: dict, summary: TrainSummary, writer: metrics.MetricWriter) -> None:
  """A logged step's line and record, once its loss and parameters are known to be finite."""
  _check_finite(scalars, step, run.config, run.manager)
  summary.losses.append((step, scalars["learning/loss"]))
  cli.log(metrics.format_step(step, scalars))
  writer.write(step, scalars)


def _check_finite(scalars: dict, step: int, config: Config, manager) -> None:
  """Stops the run at a non-finite loss, or parameter norm.

  The loss is that of the params before this step; the updated params (about to be saved) are checked
  through their norm, so a non-finite state is never checkpointed.
  """
  loss, norm = scalars["learning/loss"], scalars["learning/param_norm"]
  if not (math.isfinite(loss) and math.isfinite(norm)):
    latest = manager.latest_step() if manager is not None else None
    raise TrainingError(
      f"loss={loss}, param_norm={norm} after step {step}; lower learning_rate (now {config.learning_rate}) "
      f"or set gradient_clipping_threshold; last good checkpoint: {latest}"
    )


def _evaluate_and_log(run: Run, state: state_lib.TrainState, step: int, writer: metrics.MetricWriter) -> dict:
  """Evaluates the objective, logs its line and writes the scalars; `step` -1 is before training (logged, not
  written)."""
  scalars = run.objective.evaluate(run.mesh, run.eval_fn, state, run.data, step=step)
  cli.log(run.objective.eval_line(scalars, "before training" if step < 0 else f"after step {step}"))
  if step >= 0:
    writer.write(step, scalars)
  return scalars


def _save(run: Run, state: state_lib.TrainState, completed: int, position: dict | None = None) -> None:
  """Starts saving checkpoint <completed>, with the text pipeline's position (`position`, by default the
  iterator's now; synthetic data has none), once there is room for it."""
  checkpointing.check_room(run.config, run.manager, state)
  if run.config.dataset_type == "synthetic":
    data_state = None
  else:
    data_state = position if position is not None else run.data.get_state()
  if checkpointing.save(run.manager, state, data_state, run.config):
    cli.log(f"saving checkpoint {completed} to {checkpointing.checkpoint_dir(run.config)}")
  else:
    cli.log(f"checkpoint {completed} exists already in {checkpointing.checkpoint_dir(run.config)}; kept as it is")


def _stopped(signal_name: str, step: int, completed: int, manager) -> str:
  """The line a run stopped by a signal after `step` exits with, once checkpoint `completed` is saved."""
  what = "preempted" if signal_name == "SIGTERM" else "interrupted"
  if manager is None:
    return f"{what} ({signal_name}) after step {step}; nothing saved (enable_checkpointing=false)"
  return f"{what} ({signal_name}) after step {step}; checkpoint {completed} is saved: run the same command again to resume"


def _close(
  run: Run, goodput: metrics.Goodput, writer: metrics.MetricWriter, summary: TrainSummary, completed: int, failed: bool
):
  """The end of the loop, however it ended: the save in flight completes (before a stop, too) or its error is
  raised, and goodput is reported and written before the writer closes."""
  try:
    if run.manager is not None:
      with goodput.waiting("checkpoint"):
        run.manager.wait_until_finished()
  finally:
    summary.goodput = goodput.report()
    # A run that failed reports its own error: a metrics write failing now (the same full disk) would replace it.
    with contextlib.suppress(metrics.WriteError) if failed else contextlib.nullcontext():
      try:
        writer.write_goodput(completed, summary.goodput)
      finally:
        writer.close()
    cli.log(metrics.format_goodput(summary.goodput))


def _finish(summary: TrainSummary, config: Config, clock: metrics.StepClock) -> TrainSummary:
  memory, memory_kind = metrics.peak_memory_bytes()
  summary.steps_run = config.steps - summary.first_step
  summary.total_tokens = summary.steps_run * config.global_batch_size * config.max_target_length
  summary.time_to_first_step = clock.time_to_first_step
  summary.median_step_time = metrics.median(clock.step_times)
  summary.peak_memory_bytes = memory
  cli.log(
    f"Done: {summary.total_tokens} tokens in {summary.steps_run} steps; median step time "
    f"{summary.median_step_time:.3f} s (steps after the first); peak memory {memory / 2**30:.2f} GiB "
    f"({memory_kind}); time to first step {summary.time_to_first_step:.1f} s"
  )
  return summary


def _train_cli(config: Config, started: float) -> None:
  if config.log_config:  # The keys that differ from base.yml; config.yml in the run's folder has them all.
    defaults = pyconfig.defaults()
    changed = [f"{k}={v}" for k, v in sorted(pyconfig.given(config).items()) if v != defaults[k]]
    cli.log(
      f"Config (where it differs from base.yml; every key: {checkpointing.run_dir(config)}/config.yml): {' '.join(changed)}"
    )
  train(config, started=started)


def main(argv) -> int:
  # The command starts now: goodput's start-up and the time to first step count from here (a second main() in
  # the same process counts its own).
  return cli.run_cli(functools.partial(_train_cli, started=time.time()), argv, writes_run_dir=True)


if __name__ == "__main__":
  sys.exit(main(sys.argv))
