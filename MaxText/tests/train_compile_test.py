"""train_compile.py, tpu_topology.py and compiled_step.py: TPU slices by name, the step compiled for them through
libtpu (its memory, collectives and does-not-fit verdict), and the compiled step's file loaded by train.py.

The tests that compile for a TPU need libtpu (`TPU_COMPILE=1 bash setup.sh`) and are skipped without it; each
compiles the tiny model for a small slice in a few seconds. The file's round trip runs on this host's CPU devices.
"""

import functools
import importlib.util
import json
import math
import os
import re
import sys

import jax
import numpy as np
import pytest

from MaxText import compiled_step, metrics, optimizers, pyconfig, sharding, tpu_topology, train, train_compile
from MaxText import state as state_lib
from MaxText import step as step_lib
from MaxText.common_types import ConfigError
from MaxText.layers import models
from MaxText.tests.helpers import BASE_YML, overrides, run
from MaxText.tests.helpers import config as config_of

# A topology's compile-only client cannot read back what the tests' persistent cache (conftest.py) holds for it:
# JAX warns and compiles afresh, which is what these tests want.
pytestmark = pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache entry")
needs_libtpu = pytest.mark.skipif(
  importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed (TPU_COMPILE=1 bash setup.sh installs it)"
)
GiB = 2**30


def _tpu_config(*args, topology="v5e-4"):
  """The tiny model finalized for a TPU slice, as train_compile.py loads it: dot_product (any batch split), and
  bfloat16 at the default precision (float32 matmuls at `highest` take the TPU compiler ten times longer)."""
  tpu = (f"compile_topology={topology}", "attention=dot_product", "dtype=bfloat16", "matmul_precision=default")
  return train_compile.load_config([BASE_YML, *overrides(*tpu, *args)])


# ---------------------------------------------------------------------------------------------- topology names
@pytest.mark.parametrize(
  "name, libtpu_name, chip_config, chips_per_host, devices",
  [
    # MaxText's accelerator_to_spec_map.py gives these topology strings and host bounds.
    ("v5e-1", "v5e:1x1", "default", (1, 1, 1), 1),
    ("v5e-8", "v5e:2x4", "default", (2, 2, 1), 8),
    ("v5e-256", "v5e:16x16", "default", (2, 2, 1), 256),
    ("v6e-128", "v6e:8x16", "default", (2, 2, 1), 128),
    ("v4-8", "v4:2x2x1", "megacore", (2, 2, 1), 4),
    ("v4-384", "v4:4x4x12", "megacore", (2, 2, 1), 192),
    ("v4-4096", "v4:8x16x16", "megacore", (2, 2, 1), 2048),
    ("v5p-64", "v5:2x4x4", "megacore", (2, 2, 1), 32),
    ("v5p-640", "v5:4x4x20", "megacore", (2, 2, 1), 320),
    ("v5p-1152", "v5:4x12x12", "megacore", (2, 2, 1), 576),
    ("v5p-9216", "v5:12x16x24", "megacore", (2, 2, 1), 4608),
    ("v5p-12288", "v5:16x16x24", "megacore", (2, 2, 1), 6144),
  ],
)
def test_topology_names_give_cloud_tpu_slices(name, libtpu_name, chip_config, chips_per_host, devices):
  topology = tpu_topology.parse(name)
  assert (topology.libtpu_name, topology.chip_config, topology.chips_per_host) == (libtpu_name, chip_config, chips_per_host)
  assert topology.chips == devices


def test_every_v5p_name_is_a_box_of_its_chips_no_longer_than_another():
  """Independent of how parse searches: every accepted v5p-N has N/2 chips in whole 4x4x4 cubes (from 64 chips),
  no side over 256, and no box of the same cubes has a shorter longest side."""
  accepted = []
  for n in range(128, 12289, 128):
    try:
      shape = tpu_topology.parse(f"v5p-{n}").shape
    except ConfigError:
      continue
    accepted.append(n)
    assert math.prod(shape) == n // 2 and all(side % 4 == 0 for side in shape) and max(shape) <= 256
    cubes = n // 2 // 64
    shortest = min(
      max(a, b, cubes // (a * b)) for a in range(1, cubes + 1) for b in range(1, cubes + 1) if cubes % (a * b) == 0
    )
    assert max(shape) == 4 * shortest, (n, shape)
  assert len(accepted) == 96 - 6  # MaxText's list has all but v5p-8576, 9088, 9344, 10112, 10624, 11392.


@pytest.mark.parametrize("name", ["v5e-2", "v5e-512", "v6e-3", "v4-4", "v4-8192", "v5p-12", "v5p-8576", "v7-8", "tpu"])
def test_a_bad_topology_name_is_a_config_error_listing_the_valid_forms(name):
  with pytest.raises(ConfigError, match=r"use v5e-N or v6e-N .* v5p-N"):
    tpu_topology.parse(name)


def test_without_libtpu_a_topology_is_a_config_error_saying_how_to_install_it(monkeypatch):
  monkeypatch.setattr(tpu_topology.importlib.util, "find_spec", lambda name: None)
  with pytest.raises(ConfigError, match="TPU_COMPILE=1 bash setup.sh"):
    tpu_topology.devices(tpu_topology.parse("v5e-4"))


@pytest.mark.parametrize("slices", ["0", "-2"])
def test_compile_topology_num_slices_must_be_positive(slices):
  with pytest.raises(ConfigError, match="compile_topology_num_slices"):
    _tpu_config(f"compile_topology_num_slices={slices}")


# ---------------------------------------------------------------------------------------------- the report
@pytest.mark.parametrize(
  "message, needed, available",
  [
    (
      "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. Used 15.88G of "
      "15.75G hbm. Exceeded hbm capacity by 135.6M.",
      15.88 * GiB,
      15.75 * GiB,
    ),  # fmt: skip
    (
      "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries (160.00G) exceeds "
      "available HBM (15.75G).",
      160 * GiB,
      15.75 * GiB,
    ),  # fmt: skip
    ("RESOURCE_EXHAUSTED: out of memory somewhere", None, None),
  ],
)
def test_xla_running_out_of_hbm_is_read_from_either_message(message, needed, available):
  got = compiled_step.out_of_memory(RuntimeError(message))
  assert got == pytest.approx((needed, available)) if needed else got == (None, None)


def test_other_compile_errors_are_not_out_of_memory():
  assert compiled_step.out_of_memory(RuntimeError("INVALID_ARGUMENT: shapes do not match")) is None


def test_the_does_not_fit_line_suggests_only_what_the_config_can_still_change():
  lean = config_of("remat_policy=full", "per_device_batch_size=1", "attention=flash")
  assert compiled_step.does_not_fit_line(17 * GiB, 15.75 * GiB, "v5e", lean) == (
    "does not fit: 17.00 GiB per chip > 15.75 GiB HBM of v5e; try a larger topology"
  )
  data_parallel = ("ici_fsdp_parallelism=1", "ici_data_parallelism=-1")
  heavy = config_of("attention=dot_product", "remat_policy=minimal", *data_parallel, num_devices=2)
  assert compiled_step.does_not_fit_line(None, None, "v4", heavy) == (
    "does not fit: more than its HBM of v4; try a smaller per_device_batch_size, attention=flash, remat_policy=full, "
    "more fsdp (ici_fsdp_parallelism) or a larger topology"
  )


def test_collectives_are_counted_sync_and_async_by_opcode():
  hlo = """
  %all-gather.1 = bf16[8,64] all-gather(%p), dimensions={0}
  %ag-start = (bf16[2], bf16[8]) all-gather-start(%q), dimensions={0}
  %ag-done = bf16[8] all-gather-done(%ag-start)
  %rs = f32[2] reduce-scatter(%g), dimensions={0}
  %get-tuple-element.3 = f32[] get-tuple-element(%all-reduce.43), index=0
  %cp = f32[2] collective-permute-start(%x)
  %ra = bf16[16,4] ragged-all-to-all(%rows, %out, %in_off, %send, %out_off, %recv), replica_groups={{0,1}}
  """
  assert compiled_step.count_collectives(hlo) == {
    "all-gather": 2,
    "reduce-scatter": 1,
    "all-reduce": 0,
    "all-to-all": 0,
    "ragged-all-to-all": 1,
    "collective-permute": 1,
  }


def test_dots_are_counted_by_their_operands_dtypes_inside_fusions_and_inline():
  hlo = """
  %fused_computation.1 (param_0.3: s8[8,16], param_1.2: s8[16,4]) -> s32[8,4] {
    %param_0.3 = s8[8,16]{1,0} parameter(0)
    %param_1.2 = s8[16,4]{1,0} parameter(1)
    ROOT %dot.2 = s32[8,4]{1,0} dot(%param_0.3, %param_1.2), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  }
  ENTRY %main {
    %p = (f32[2,8], bf16[8,4]) parameter(0)
    %x = f32[2,8]{1,0} get-tuple-element(%p), index=0
    %w = bf16[8,4]{1,0} get-tuple-element(%p), index=1
    %conv.1 = f32[2,4]{1,0} convolution(%x, %w), dim_labels=bf_io->bf
    %mixed = f32[2,4]{1,0} dot(f8e4m3fn[2,8]{1,0} %a, f8e5m2[8,4]{1,0} %b), lhs_contracting_dims={1}
    %fusion.7 = s32[8,4]{1,0} fusion(%q, %r), kind=kOutput, calls=%fused_computation.1
    %dot_product_fusion = f32[2,4]{1,0} fusion(%x), kind=kLoop, calls=%other
  }
  """
  assert train_compile.dot_dtypes(hlo) == {"s8": 1, "f32/bf16": 1, "f8e4m3fn/f8e5m2": 1}


def test_dots_of_a_compiled_function_by_operand_dtype():
  """Two int8 x int8 -> int32 matmuls and one float32 one, compiled for this host's CPU: its optimized HLO names
  the operands, often parameters of the fused computation that holds the dot. (The CPU compiler turns bfloat16
  dots, and int8 ones with a transposed operand, into float32 / int32 ones: only dots it keeps are asked of it.)"""

  def f(a, b, c, x, y):
    int8 = functools.partial(jax.lax.dot, preferred_element_type=jax.numpy.int32)
    return int8(a, b), int8(c, b), x @ y

  i8, f32 = jax.numpy.int8, jax.numpy.float32
  shapes = [((8, 16), i8), ((16, 4), i8), ((32, 16), i8), ((8, 16), f32), ((16, 4), f32)]
  args = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes]
  hlo = jax.jit(f).lower(*args).compile().as_text()
  assert train_compile.dot_dtypes(hlo) == {"s8": 2, "f32": 1}


def _shard_bytes(x):
  return math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize


@needs_libtpu
def test_a_tiny_model_compiles_for_v5e_and_its_arguments_are_the_state_and_batch_shards():
  # Dimensions in whole TPU tiles (8 x 128), so the only layout padding is that of the scalars.
  cfg = _tpu_config(
    "override_model_config=true", "base_emb_dim=256", "base_num_query_heads=8", "base_num_kv_heads=8", "head_dim=128",
    "base_mlp_dim=512", "vocab_size=256", "max_target_length=128", "ici_fsdp_parallelism=4",
  )  # fmt: skip
  compiled, report, mesh = train_compile.compile_train_step(cfg)
  assert mesh.devices.flat[0].platform == "tpu" and mesh.devices.size == 4 and cfg.hardware == "tpu"
  model = models.Transformer(cfg, mesh)
  schedule = optimizers.learning_rate_schedule(cfg)
  tx = optimizers.create_optimizer(cfg, schedule)
  step = step_lib.jit_train_step(
    cfg, mesh, model=model, schedule=schedule, tx=tx, layout=state_lib.state_layout(model, cfg, tx, mesh)
  )
  state = sum(_shard_bytes(x) for x in jax.tree_util.tree_leaves(step.abstract_state))
  batch = sum(_shard_bytes(x) for x in step.abstract_batch.values())
  # Scalars (step, Adam's count) take a 512-byte tile each: a few KiB of padding at most.
  assert 0 <= report.arguments - (state + batch) <= 4096
  assert 0 <= report.aliased - state <= 4096  # The donated state is overwritten by the new one.
  assert report.hbm == 15.75 * GiB and report.fits and report.total < report.hbm
  assert report.temporaries > 0 and report.generated_code > 0 and report.flops > 0
  assert report.model_flops == metrics.training_flops_per_device(cfg).total
  lines = "\n".join(report.lines())
  for field in ("arguments", "outputs", "temporaries", "total", "15.75 GiB HBM: fits", "FLOPs", "all-gather"):
    assert field in lines
  assert "TPU v5 lite" in report.target


@needs_libtpu
def test_autoselected_attention_is_splash_on_the_topology_s_tpu_devices():
  """The mesh's devices are TPUs, so `autoselected` picks splash attention (a Pallas kernel: a TPU custom call in
  the HLO), even at init, whose dummy batch must split over the 4 batch shards."""
  compiled, _, _ = train_compile.compile_train_step(_tpu_config("attention=autoselected", "max_target_length=512"))
  assert "tpu_custom_call" in compiled.as_text()
  plain, _, _ = train_compile.compile_train_step(_tpu_config("max_target_length=512"))
  assert "tpu_custom_call" not in plain.as_text()


@needs_libtpu
def test_fsdp_gathers_the_parameters_where_data_parallelism_reduces_the_gradients_only():
  _, fsdp, _ = train_compile.compile_train_step(_tpu_config("ici_fsdp_parallelism=4"))
  _, data, _ = train_compile.compile_train_step(_tpu_config("ici_fsdp_parallelism=1", "ici_data_parallelism=4"))
  assert fsdp.collectives["all-gather"] > 0
  assert data.collectives["all-gather"] == 0 and data.collectives["all-reduce"] > 0


@needs_libtpu
def test_two_slices_compile_over_dcn():
  cfg = _tpu_config("compile_topology_num_slices=2", "dcn_data_parallelism=2")
  assert (cfg.num_devices, cfg.num_slices) == (8, 2)
  _, report, mesh = train_compile.compile_train_step(cfg)
  assert {d.slice_index for d in mesh.devices.flat} == {0, 1}
  assert dict(mesh.shape)["data"] == 2 and report.collectives["all-reduce"] > 0


@needs_libtpu
def test_a_step_that_does_not_fit_exits_1_with_one_line(capsys):
  # The [batch, length, vocab] float32 logits alone are 16 x 2048 x 256000 x 4 bytes = 31 GiB per chip.
  big = ("dtype=bfloat16", "override_model_config=true", "vocab_size=256000", "max_target_length=2048")
  argv = ["train_compile.py", BASE_YML, *overrides("compile_topology=v5e-4", "attention=dot_product", *big)]
  argv.append("per_device_batch_size=16")
  code = train_compile.main(argv)
  err = capsys.readouterr().err
  assert code == 1 and err.count("\n") == 1
  assert re.match(r"error: does not fit: [\d.]+ GiB per chip > [\d.]+ GiB HBM of v5e; try ", err)


@needs_libtpu
@pytest.mark.parametrize(
  "quantization, dtypes", [("int8", {"s8"}), ("fp8_full", {"f8e4m3fn", "f8e4m3fn/f8e5m2"}), ("", set())]
)
def test_a_quantized_step_reports_its_quantized_dots_and_gib_per_chip(quantization, dtypes, capsys):
  """The tiny model on a v5e-4: int8 training's matmuls are s8 dots in the optimized HLO, fp8_full's e4m3 forward
  and e4m3 x e5m2 gradient ones; unquantized, none are. Attention's own products stay bfloat16 either way."""
  tpu = ("compile_topology=v5e-4", "attention=dot_product", "dtype=bfloat16", "matmul_precision=default")
  argv = ["train_compile.py", BASE_YML, *overrides(*tpu, f"quantization={quantization}")]
  assert train_compile.main(argv) == 0
  summary = capsys.readouterr().out.strip().splitlines()[-1]
  found = re.fullmatch(r"Summary: dots: (.*); ([\d.]+) MiB per chip of 15\.75 GiB HBM \(v5e-4 .*\)", summary)
  assert found, summary
  dots = dict(item.split(" x ") for item in found.group(1).split(", "))  # dtype -> count
  quantized = {"s8", "f8e4m3fn", "f8e5m2", "f8e4m3fn/f8e5m2", "f8e5m2/f8e4m3fn"}
  assert "bf16" in dots and float(found.group(2)) > 0
  assert dtypes <= set(dots) & quantized if quantization else not set(dots) & quantized


# ---------------------------------------------------------------------------------------------- the file
TRAIN = (
  "steps=3",
  "learning_rate_schedule_steps=3",
  "learning_rate=1e-2",
  "warmup_steps_fraction=0",
  "ici_fsdp_parallelism=4",
  "ici_data_parallelism=2",
)


@pytest.mark.slow
def test_the_compiled_step_file_loads_in_train_and_gives_the_same_losses(tmp_path):
  """train_compile.py (a process of its own: it never compiles through the tests' persistent cache) compiles for
  8 CPU devices (an empty compile_topology) and writes the file; train.train loads it and trains as it would."""
  path = str(tmp_path / "step.bin")
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
  args = [sys.executable, "MaxText/train_compile.py", BASE_YML, *overrides(*TRAIN, f"compiled_trainstep_file={path}")]
  proc = run(args, env, timeout=120)
  assert proc.returncode == 0 and "Wrote the compiled step" in proc.stdout, proc.stderr
  config = functools.partial(config_of, f"base_output_directory={tmp_path}", num_devices=8)
  loaded = train.train(config(*TRAIN, f"compiled_trainstep_file={path}", "run_name=loaded"))
  fresh = train.train(config(*TRAIN, "run_name=fresh"))
  assert len(loaded.losses) == 3
  np.testing.assert_array_equal([loss for _, loss in loaded.losses], [loss for _, loss in fresh.losses])


def _write_step_file(path, cfg, devices):
  """A file with the fingerprint of (cfg, devices) and no executable: enough to test the checks made before loading."""
  mesh = sharding.create_mesh(cfg, devices)
  with open(path, "w", encoding="utf-8") as f:
    f.write(json.dumps(compiled_step.fingerprint(cfg, mesh)) + "\nno executable")


@pytest.mark.mesh
def test_a_step_file_for_another_step_is_a_config_error_before_any_work(tmp_path):
  path = tmp_path / "step.bin"
  _write_step_file(path, config_of(*TRAIN, num_devices=8), jax.devices())
  config = functools.partial(config_of, f"base_output_directory={tmp_path}", f"compiled_trainstep_file={path}")
  with pytest.raises(ConfigError, match=r"compiled for another step: .*per_device_batch_size=2.0 there, 4.0 here"):
    train.train(config(*TRAIN, "per_device_batch_size=4", num_devices=8))
  with pytest.raises(ConfigError, match=r"learning_rate_schedule_steps=3 there, 5 here"):  # The schedule is compiled in.
    train.train(config(*TRAIN, "learning_rate_schedule_steps=5", num_devices=8))
  with pytest.raises(ConfigError, match=r"it is for 8 x cpu \(cpu\) in 1 slice\(s\), this run has 4 x cpu"):
    train.train(config(*TRAIN[:-1], num_devices=4), jax.devices()[:4])
  with pytest.raises(ConfigError, match="no such file"):
    train.train(config(*TRAIN, f"compiled_trainstep_file={tmp_path}/missing.bin", num_devices=8))
  (tmp_path / "other.bin").write_bytes(b"not a step\n")
  with pytest.raises(ConfigError, match="not a train step written by train_compile.py"):
    train.train(config(*TRAIN, f"compiled_trainstep_file={tmp_path}/other.bin", num_devices=8))
  assert not (tmp_path / "test").exists()  # Refused before the run wrote anything.


def test_a_fingerprint_leaves_out_keys_that_do_not_shape_the_step():
  cfg = pyconfig.load([BASE_YML, *overrides()], num_devices=1, env={})
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape((1,) * len(cfg.mesh_axes)), tuple(cfg.mesh_axes))
  keys = compiled_step.fingerprint(cfg, mesh)["config"]
  assert {"run_name", "steps", "metrics_file", "dataset_type", "ici_fsdp_parallelism"}.isdisjoint(keys)
  assert {"emb_dim", "per_device_batch_size", "learning_rate_schedule_steps", "ici_mesh_shape", "remat_policy"} <= set(keys)


def test_a_compiled_step_moves_between_objectives_of_one_step_only(tmp_path):
  """SFT's train step is language modelling's (only the records differ), so a step compiled for one is the other's;
  DPO's is another step, refused before loading in one line naming both."""
  mesh = jax.sharding.Mesh(
    np.array(jax.devices()[:1]).reshape((1,) * 7), ("data", "stage", "fsdp", "sequence", "context", "tensor", "expert")
  )
  lm, sft, dpo = (
    pyconfig.load([BASE_YML, *overrides("dataset_type=hf", f"objective={o}")], num_devices=1, env={})
    for o in ("lm", "sft", "dpo")
  )
  assert compiled_step.fingerprint(lm, mesh) == compiled_step.fingerprint(sft, mesh)
  assert compiled_step._mismatch(compiled_step.fingerprint(lm, mesh), compiled_step.fingerprint(sft, mesh)) == ""
  mismatch = compiled_step._mismatch(compiled_step.fingerprint(lm, mesh), compiled_step.fingerprint(dpo, mesh))
  assert mismatch == "it is the train step of objective=lm, this run's is objective=dpo's"


@needs_libtpu
@pytest.mark.parametrize("megablox", ["true", pytest.param("false", marks=pytest.mark.slow)])
def test_a_tiny_mixture_of_experts_compiles_with_expert_parallelism(megablox):
  """4 experts over ici_expert_parallelism=4: the dropless rows travel by all-to-all, and the grouped matmuls are
  the Pallas megablox kernels (gmm, tgmm: named in the compiled HLO) with megablox=true, XLA's ragged dot without."""
  moe = ("decoder_block=mixtral", "override_model_config=true", "num_experts=4", "num_experts_per_tok=2")
  dims = ("base_emb_dim=256", "base_mlp_dim=512", "head_dim=128", "base_num_query_heads=2", "base_num_kv_heads=2")
  cfg = _tpu_config(*moe, *dims, "ici_expert_parallelism=4", "ici_fsdp_parallelism=1", f"megablox={megablox}")
  compiled, report, mesh = train_compile.compile_train_step(cfg)
  assert dict(mesh.shape)["expert"] == 4 and report.fits
  assert report.collectives["ragged-all-to-all"] > 0  # the exact-size exchange (moe.RAGGED_EXCHANGE_PLATFORMS)
  assert bool(re.search(r"\bt?gmm\b", compiled.as_text())) == (megablox == "true")


@pytest.mark.slow  # 20 s; the tiny mixture of experts' compiles are its fast siblings.
@needs_libtpu
def test_a_small_deepseek_compiles_with_splash_attention_megablox_and_expert_parallelism():
  """DeepSeek-V3's shapes per head (192-wide query and key, 128-wide values: padded to one head_dim for the
  kernel) at a small width, expert 2 x fsdp 2: MLA runs splash attention (a TPU custom call), the experts megablox
  and all-to-all, with the routing bias update on."""
  dims = ("model_name=deepseek3-tiny", "override_model_config=true", "base_emb_dim=256", "base_mlp_dim=512",
          "base_moe_mlp_dim=256", "base_num_query_heads=2", "base_num_kv_heads=2", "q_lora_rank=128",
          "kv_lora_rank=128", "qk_nope_head_dim=128", "qk_rope_head_dim=64", "v_head_dim=128", "num_experts=4",
          "n_routing_groups=2", "topk_routing_group=1", "routed_bias_update_rate=0.001")  # fmt: skip
  mesh_keys = ("ici_expert_parallelism=2", "ici_fsdp_parallelism=2", "attention=flash", "max_target_length=512")
  compiled, report, mesh = train_compile.compile_train_step(_tpu_config(*dims, *mesh_keys))
  text = compiled.as_text()
  assert report.fits and report.collectives["all-to-all"] > 0
  assert "tpu_custom_call" in text and re.search(r"\bt?gmm\b", text)


@pytest.mark.slow
@needs_libtpu
def test_mixtral_8x7b_fits_a_v5p_64_with_expert_parallelism(capsys):
  """The published Mixtral 8x7B (46.7B parameters), 4096-token rows, experts over ici_expert_parallelism=8 and
  FSDP over the other 4 of 32 v5p chips: it compiles and fits (figures in docs/changelog.md)."""
  argv = ["train_compile.py", BASE_YML, "model_name=mixtral-8x7b", "compile_topology=v5p-64", "ici_expert_parallelism=8"]
  argv += ["ici_fsdp_parallelism=-1", "per_device_batch_size=4", "max_target_length=4096", "attention=flash"]
  argv += ["remat_policy=full", "dataset_type=synthetic", "reuse_example_batch=1", "run_name=compile", "jax_cache_dir="]
  assert train_compile.main(argv) == 0
  assert "HBM: fits" in capsys.readouterr().out
