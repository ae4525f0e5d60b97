"""Ahead-of-time compilation of the train step for a TPU slice that is not here:

  python3 MaxText/train_compile.py MaxText/configs/base.yml compile_topology=v5e-256 compile_topology_num_slices=1 \\
    [compiled_trainstep_file=PATH] [key=value ...]

It compiles the step train.py runs (step.jit_train_step and step.compile_step: the same function, shardings and
compiler options) for compile_topology (tpu_topology.py's names) through libtpu, on this host's CPU, and prints per
device the memory the step needs against the chip's HBM, its FLOPs and its collectives. Exit code 0 when it fits;
1 and one line (`does not fit: ...`) when it does not, whether XLA refuses to compile it or the compiled step
needs more than the chip has; 2 for a config mistake. Its last line sums the program up: the operand dtypes of the
dots (and convolutions) in the optimized HLO, e.g. `dots: s8 x 27, bf16 x 3` (the 16B step with quantization=int8:
its matmuls are s8 dots, fp8's f8e4m3fn ones; mixed operands read `f8e4m3fn/f8e5m2`; instructions, so one in the
scanned layers' loop counts once), and the GiB per chip against the HBM.
With compiled_trainstep_file=PATH it also writes the executable, which `train.py compiled_trainstep_file=PATH` on
that slice loads instead of compiling.

An empty compile_topology compiles for this host's own devices, as train.py would (the file then loads in a
train.py run here: the tests check the file that way on the CPU).

It imports step.py, where train.py's step lives, so what it compiles is that step itself, not a copy; no entry-point
script imports another.
"""

import collections
import functools
import re
import sys
import time

if __package__ in (None, ""):  # Run as a script: see MaxText/script_path.py.
  import script_path  # noqa: F401

import jax

from MaxText import cli, compiled_step, objectives, pyconfig, step, tpu_topology
from MaxText.common_types import Config, ConfigError, TrainingError
from MaxText.layers import pipeline

GiB = 2**30


# An HLO instruction's name and the element type of its result: `%fusion.3 = s8[2,64]{1,0} fusion(...)` (a tuple
# result, `(bf16[2], s32[])`, gives its first element's).
_DEFINITION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\(?([a-z][a-z0-9]*)\[")
# A dot or convolution and its operands: `%dot.1 = s32[8,8]{1,0} dot(%a, %b), lhs_contracting_dims=...`; an
# operand may carry its type inline (`dot(s8[8,16]{1,0} %a, ...)`, HLO printed with operand shapes).
_DOT = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*.*?\s(?:dot|convolution)\(([^)]*)\)")
_OPERAND = re.compile(r"(?:([a-z][a-z0-9]*)\[[^\]]*\]\S*\s+)?%([\w.\-]+)")


def dot_dtypes(hlo_text: str) -> dict[str, int]:
  """Dots and convolutions in HLO text by the element type of their operands, most first: "s8" when both operands
  are s8, "f32/bf16" when they differ (instructions: one in a loop body counts once). Optimized HLO names operands,
  not their types, so each is looked up by its name (unique in an HLO module), inside fused computations too."""
  lines = hlo_text.splitlines()
  types = {}
  for line in lines:
    found = _DEFINITION.match(line)
    if found:
      types[found.group(1)] = found.group(2)
  counts = collections.Counter()
  for line in lines:
    found = _DOT.match(line)
    if not found:
      continue
    operands = [inline or types.get(name, "?") for inline, name in _OPERAND.findall(found.group(1))[:2]]
    counts[operands[0] if len(set(operands)) == 1 else "/".join(operands)] += 1
  return dict(counts.most_common())


def summary(report: compiled_step.StepReport, dots: dict[str, int]) -> str:
  """One line: the dots' operand dtypes and the GiB per chip (XLA's peak; the allocated total with offloading)."""
  per_chip = report.needed if report.needed is not None else report.total
  size = f"{per_chip / GiB:.2f} GiB" if per_chip >= GiB / 10 else f"{per_chip / 2**20:.2f} MiB"  # a tiny model's
  hbm = "" if report.hbm is None else f" of {report.hbm / GiB:.2f} GiB HBM"
  dot_text = ", ".join(f"{dtype} x {n}" for dtype, n in dots.items()) or "none"
  return f"Summary: dots: {dot_text}; {size} per chip{hbm} ({report.target})"


class Phases:
  """One line as each phase starts, with the seconds since the command started (this object made): compiling a
  large step takes minutes."""

  def __init__(self):
    self.start = time.monotonic()

  def __call__(self, what: str) -> None:
    cli.log(f"[{time.monotonic() - self.start:6.1f} s] {what}")


def load_config(argv, phase: Phases | None = None) -> Config:
  """The config finalized for compile_topology's devices (hardware=tpu), or for this host's when it is empty."""
  phase = phase or Phases()
  values = pyconfig.parse(argv)
  if values["compiled_trainstep_file"]:  # Written after compiling: refused now, not after minutes of work.
    cli.check_writable("compiled_trainstep_file", values["compiled_trainstep_file"], folder=False)
  slices = _num_slices(values)
  if not values["compile_topology"]:
    if slices != 1:
      raise ConfigError(f"compile_topology_num_slices={slices} needs a compile_topology, e.g. compile_topology=v5e-256")
    return cli.load_config(argv)  # This host's devices, set up as for train.py.
  jax.config.update("jax_platforms", "cpu")  # The slice's devices come from libtpu; JAX itself stays on the CPU.
  phase(f"building the topology {values['compile_topology']} x {slices} slice(s) (libtpu)")
  devices = _topology_devices(values["compile_topology"], slices)
  # Hardware-dependent choices (attention kernels, ...) follow the mesh's devices; hardware=tpu says so too.
  return pyconfig.finalize({**values, "hardware": "tpu"}, num_devices=len(devices), num_slices=slices)


def _num_slices(values) -> int:
  slices = values["compile_topology_num_slices"]
  if slices == 0 or slices < -1:
    raise ConfigError(f"compile_topology_num_slices={slices} must be positive (or -1 for one slice)")
  return 1 if slices == -1 else slices


@functools.cache
def _topology_devices(name: str, num_slices: int) -> list[jax.Device]:
  return tpu_topology.devices(tpu_topology.parse(name), num_slices)


def compile_train_step(
  config: Config, phase: Phases | None = None
) -> tuple[jax.stages.Compiled, compiled_step.StepReport, jax.sharding.Mesh]:
  """(compiled step, its report, mesh); TrainingError with the does-not-fit line when XLA runs out of HBM."""
  phase = phase or Phases()
  if config.compile_topology:
    devices = _topology_devices(config.compile_topology, config.num_slices)
    chip = tpu_topology.parse(config.compile_topology).generation
    slices = f"{config.num_slices} slice{'s' if config.num_slices > 1 else ''}"
    target = f"{config.compile_topology} ({len(devices)} x {devices[0].device_kind}, {slices})"
  else:
    devices = jax.devices()
    chip = devices[0].device_kind
    target = f"this host ({len(devices)} x {chip})"
  phase(f"building the mesh, the model and the state's layout for {target}")
  mesh, model, schedule, tx, layout = step.build(config, devices)
  start = time.time()
  phase("lowering the train step")
  lowered = step.jit_train_step(config, mesh, model=model, schedule=schedule, tx=tx, layout=layout).lower()
  phase("compiling the train step (XLA)")
  try:
    compiled = step.compile_step(lowered, mesh)
  except jax.errors.JaxRuntimeError as e:
    needed = compiled_step.out_of_memory(e)
    if needed is None:
      raise
    raise TrainingError(compiled_step.does_not_fit_line(*needed, chip, config)) from None
  seconds = time.time() - start
  phase("memory and cost analysis of the compiled step")
  model_flops = objectives.get(config).flops().total
  report = compiled_step.report(compiled, config, mesh, target, chip, seconds, model_flops)
  phase("done")
  return compiled, report, mesh


def _main(config: Config, phase: Phases) -> None:
  compiled, report, mesh = compile_train_step(config, phase)
  cli.log("\n".join(report.lines()))
  if pipeline.num_stages(config) > 1:
    cli.log(pipeline.describe(config))
  cli.log(summary(report, dot_dtypes(compiled.as_text())))
  if not report.fits:
    raise TrainingError(report.does_not_fit(config))
  if config.compiled_trainstep_file:
    compiled_step.save(config.compiled_trainstep_file, compiled, config, mesh)
    cli.log(f"Wrote the compiled step to {config.compiled_trainstep_file}")


def main(argv) -> int:
  phase = Phases()  # The command starts now: a second main() in the same process counts from its own start.
  return cli.run_cli(functools.partial(_main, phase=phase), argv, load=functools.partial(load_config, phase=phase))


if __name__ == "__main__":
  # Never through the persistent compilation cache: a CPU executable read back from it serializes incompletely
  # (jax 0.10.2: "Function ... not found" when the loaded step runs), and a cached compile time says nothing.
  jax.config.update("jax_enable_compilation_cache", False)
  sys.exit(main(sys.argv))
