"""Pipeline parallelism: the decoder layers split into stages over the `stage` mesh axis.

The schedule is MaxText's (and GPipe's, Huang et al. 2019, made circular as in Narayanan et al. 2021): S stages,
each running `num_layers_per_pipeline_stage` (LPS) consecutive layers, the whole stack passed `num_pipeline_repeats`
(R) times, so layer l = (r * S + s) * LPS + j is layer j of stage s in repeat r. The batch is cut into M
`num_pipeline_microbatches`. At iteration t stage s works on item k = t - s (microbatch k % M, repeat k // M) when
0 <= k < M * R; the other iterations are the bubble. After each iteration every stage's output moves one stage on
(a collective permute over the stage axis), and stage S-1's result for item k is stored for microbatch k % M,
where stage 0 reads it back for the next repeat (M >= S makes it ready in time). Iterations: M * R + S - 1, of
which S - 1 are bubble: the fraction `bubble_fraction`.

All stages run one program (SPMD): the stage function is vmapped over the stage dimension, which the mesh's
`stage` axis shards, so each device computes its own stage. The model takes the parameters in its usual layout (the
scanned stack, [layers, ...], sharded over `stage` in contiguous blocks by the `layers` rule) and views the
pipelined ones as [R, S, LPS, ...] for the schedule. With R = 1 each device's block is its stage's layers. With
R > 1 (circular) stage s needs layers s, S + s, 2S + s, ... (times LPS), which the natural order spreads over every
block, so the training state holds them stage-major instead (to_stored: [S, R, LPS, ...] flattened, each block
one stage's layers) and the train step views them in the natural order for the model (to_natural): a reshape and
a transpose that XLA folds into the pipeline's own view, so the step moves no layer between devices. The stage-major
order is the training state's alone (parameters and whatever is shaped like them: the optimizer's moments, the
reference model): checkpoints, decoding and RL's rollouts get the natural order, at the boundaries (checkpointing/,
rl/rollouts.py), so checkpoints are the same with and without pipelining.

The backward pass recomputes the forward (rematerialisation, remat_policy != "none") in checkpoints of k
consecutive iterations (iterations_per_checkpoint, k dividing the count T = M * R + S - 1, so no extra iteration
runs): it keeps each checkpoint's carry (the device's stage of the state and the microbatch buffer) and, while it
differentiates one checkpoint, the layer inputs of its k iterations. With k = 1 each iteration's stage is its own
checkpoint, and the pass keeps every iteration's stage input: right for one repeat of many layers per stage, but
on llama2-70b's circular schedule (161 iterations of one layer) 10 GiB per device; in 7 checkpoints of 23 it
peaks 2.5 GiB lower. Either way the backward runs each layer's forward the same number of times (the forward, the
checkpoint's recompute, then what the layer's own remat_policy recomputes), and the loss is the same bit for bit;
the weights' gradients, summed over the iterations in another order (each chunk's sum, then the chunks'), to
float32 rounding.

Only training runs through the pipeline (and evaluation, which uses the training forward pass); prefill and
decoding run the layers in order on any mesh.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import traverse_util
from jax.ad_checkpoint import checkpoint_name

from MaxText import common_types as ct
from MaxText import sharding
from MaxText.common_types import Config
from MaxText.layers import decoders

# Sown values (mixture of experts) that are a mean over the tokens of a call: averaged over microbatches. Others
# (counts) add up.
MEAN_OVER_MICROBATCHES = ("moe_lb_loss",)
# The name of each layer's input in apply_layers: what a chunked schedule keeps of an iteration (_pipelined).
LAYER_INPUT = "pipeline_layer_input"


def num_stages(config: Config) -> int:
  """The pipeline's stages: the size of the mesh axes of activation_stage."""
  sizes = sharding.axis_sizes(config)
  return math.prod(sizes[axis] for axis in sharding.mesh_axes_of(ct.STAGE, config))


def runs(config: Config, mesh, model_mode: str) -> bool:
  """Whether the model's forward pass runs through the pipeline."""
  return mesh is not None and model_mode == ct.MODEL_MODE_TRAIN and num_stages(config) > 1


def bubble_fraction(config: Config) -> float:
  """(S - 1) / (R * M + S - 1): the share of stage-iterations that do no work."""
  s = num_stages(config)
  return (s - 1) / (config.num_pipeline_repeats * config.num_pipeline_microbatches + s - 1)


def describe(config: Config) -> str:
  """The schedule in one line, for the start of a run."""
  s = num_stages(config)
  return (
    f"Pipeline: {s} stages x {config.num_layers_per_pipeline_stage} layers x {config.num_pipeline_repeats} repeats "
    f"({config.pipeline_parallel_layers} pipelined layers), {config.num_pipeline_microbatches} microbatches; "
    f"bubble {bubble_fraction(config):.1%} of stage-iterations"
  )


def stores_stage_major(config: Config) -> bool:
  """Whether the training state holds the pipelined layers stage-major (to_stored): a circular schedule (R > 1)
  over a scanned stack. With R = 1 the stage-major order is the natural one; unrolled layers are separate arrays."""
  return num_stages(config) > 1 and config.num_pipeline_repeats > 1 and config.scan_layers


def to_stored(config: Config, tree):
  """A tree holding parameter-shaped leaves (params, a train state, gradients) with the pipelined layers of the
  stack reordered from the natural order to the stage-major one the training state keeps (see the module
  docstring); the other leaves as they are. Exact (a reshape and a transpose); the identity unless
  stores_stage_major(config)."""
  return _reorder(config, tree, to_stage_major=True)


def to_natural(config: Config, tree):
  """to_stored's inverse: the layers back in the natural order (what checkpoints, decoding and the model take)."""
  return _reorder(config, tree, to_stage_major=False)


def _reorder(config: Config, tree, to_stage_major: bool):
  if not stores_stage_major(config):
    return tree
  stack = decoders.layer_stacks(config)[-1]
  n, s, r = config.pipeline_parallel_layers, num_stages(config), config.num_pipeline_repeats
  lps = config.num_layers_per_pipeline_stage
  outer, inner = (r, s) if to_stage_major else (s, r)

  def reorder(path, leaf):
    # A leaf of the stack: the dict keys its path ends with hold the stack's name, as a parameter's do
    # (layers/mlp/wo/kernel) and Adam's moments' (opt_state/.../mu/layers/mlp/wo/kernel), and its leading axis is the
    # stack's (Adafactor's placeholders of shape [1] are not).
    keys = []
    for key in reversed(path):
      if not isinstance(key, jax.tree_util.DictKey):
        break
      keys.append(key.key)
    if stack.name not in keys or jnp.ndim(leaf) == 0 or jnp.shape(leaf)[0] != stack.count:
      return leaf
    rest = leaf.shape[1:]
    head = jnp.swapaxes(leaf[:n].reshape(outer, inner, lps, *rest), 0, 1).reshape(n, *rest)
    return head if n == stack.count else jnp.concatenate([head, leaf[n:]])

  return jax.tree_util.tree_map_with_path(reorder, tree)


def apply_layers(block: nn.Module, params, x, segment_ids, positions, indices, rng):
  """The layers of `params` (stacked, [n, ...]) in order on x, by `block` (a decoder layer, remat included);
  indices [n] are their layer numbers. Returns (x, what they sowed stacked [n, ...])."""

  def layer(x, p_and_index):
    p, index = p_and_index
    x = checkpoint_name(x, LAYER_INPUT)
    rngs = {} if rng is None else {"dropout": jax.random.fold_in(rng, index)}
    (x, _), sown = block.apply(
      {"params": p}, x, segment_ids, positions, None, None, None, index, rngs=rngs, mutable=["intermediates"]
    )
    return x, sown.get("intermediates", {})

  return jax.lax.scan(layer, x, (params, indices))


def run(block: nn.Module, params, x, segment_ids, positions, first_layer: int, rng):
  """A stack of layers on x [batch, length, embed], its first pipeline_parallel_layers through the pipeline and
  the rest after it, in order: (x after them, what they sowed as {path: [layers, ...]}).

  block: the decoder layer (remat included), whose config and mesh the pipeline follows; params: the stack's
  parameters, [layers, ...] (layer number `first_layer` first); rng: dropout key or None."""
  n = block.config.pipeline_parallel_layers
  count = jax.tree_util.tree_leaves(params)[0].shape[0]
  head = jax.tree_util.tree_map(lambda p: p[:n], params)
  x, sown = _pipelined(block, head, x, segment_ids, positions, first_layer, rng)
  if n == count:
    return x, sown
  tail = jax.tree_util.tree_map(lambda p: p[n:], params)
  x, rest = apply_layers(block, tail, x, segment_ids, positions, first_layer + jnp.arange(n, count), rng)
  rest = {path: values[0] for path, values in traverse_util.flatten_dict(rest).items()}
  flat = traverse_util.flatten_dict(sown)
  return x, traverse_util.unflatten_dict({path: jnp.concatenate([flat[path], rest[path]]) for path in flat})


def _pipelined(block: nn.Module, params, x, segment_ids, positions, first_layer: int, rng):
  """run()'s pipeline: params [pipeline_parallel_layers, ...]."""
  config, mesh = block.config, block.mesh
  s, m, r = num_stages(config), config.num_pipeline_microbatches, config.num_pipeline_repeats
  lps = config.num_layers_per_pipeline_stage
  b, length, emb = x.shape
  mb = b // m

  def microbatches(a):  # row i goes to microbatch i % m: each device keeps its own rows
    return jnp.swapaxes(a.reshape(mb, m, *a.shape[1:]), 0, 1)

  inputs, segs, poss = microbatches(x), microbatches(segment_ids), microbatches(positions)
  # [R, S, LPS, ...]: the stage dimension over the stage mesh axis, as is its [S, R, LPS] table of layer numbers.
  stage_params = jax.tree_util.tree_map(lambda p: _over_stages(p.reshape(r, s, lps, *p.shape[1:]), mesh, config), params)
  stages = jnp.arange(s)
  layer_of_stage = first_layer + (jnp.arange(r)[None, :, None] * s + stages[:, None, None]) * lps + jnp.arange(lps)
  state_axes = (ct.STAGE, ct.BATCH, ct.LENGTH, ct.ACT_EMBED)

  iterations = m * r + s - 1
  # The stage's weight gradient against one stage input, per device (both spread over the devices, the input over all
  # but the stage axis): what a chunked schedule's second accumulator costs (iterations_per_checkpoint).
  weight_bytes = sum(p.size * p.dtype.itemsize for p in jax.tree_util.tree_leaves(params))
  chunk = iterations_per_checkpoint(config, iterations, weight_bytes / (s * mb * length * emb * x.dtype.itemsize))

  def stage(p, repeat, x, seg, pos, key, layers):
    return _stage(block, p, repeat, x, seg, pos, key, layers)

  if chunk == 1 and config.remat_policy != "none":
    # Each iteration keeps only its inputs for the backward pass, which recomputes the stage's forward (its layers
    # rematerialised by remat_policy inside): without this, every iteration's layer inputs stay live at once.
    stage = jax.checkpoint(stage, policy=jax.checkpoint_policies.nothing_saveable)
  elif chunk > 1:
    # The chunk is the checkpoint (_scan_in_chunks). Within one chunk's backward, each iteration keeps its layers'
    # inputs but not the repeat's weights it picked (recomputed, the pick only): else k picks stay live at once.
    stage = jax.checkpoint(stage, policy=jax.checkpoint_policies.save_only_these_names(LAYER_INPUT))
  vmapped = jax.vmap(
    stage,
    in_axes=(1, 0, 0, 0, 0, None if rng is None else 0, 0),
    spmd_axis_name=_stage_axes(config),
  )

  def iteration(carry, t):
    state, buffer = carry
    item = t - stages  # [S]: the item each stage works on
    micro, repeat = item % m, jnp.clip(item // m, 0, r - 1)
    # The buffer is read and written by a one-hot select over its microbatch dimension, which every device does on
    # its own rows: XLA partitioned a dynamic slice or update of it by first gathering the buffer's rows from every
    # device (on llama3.1-405b over 128 chips, 32 GiB per device per iteration).
    state = state.at[0].set(_pick(buffer, jnp.arange(m) == t % m))
    state = sharding.constrain(state, state_axes, mesh, config)
    keys = None if rng is None else jax.vmap(lambda i: jax.random.fold_in(rng, i))(t * s + stages)
    out, sown = vmapped(stage_params, repeat, state, segs[micro], poss[micro], keys, layer_of_stage)
    out = sharding.constrain(out, state_axes, mesh, config)
    last = t - (s - 1)  # the item stage S-1 finished: stored for its microbatch (read back by stage 0)
    done = (last >= 0) & (last < m * r)
    buffer = _put(buffer, out[s - 1], (jnp.arange(m) == last % m) & done)
    valid = (item >= 0) & (item < m * r)
    return (jnp.roll(out, 1, axis=0), buffer), (sown, valid, repeat)  # roll: each output moves one stage on

  state = jnp.zeros((s, mb, length, emb), x.dtype)
  (_, buffer), (sown, valid, repeat) = _scan_in_chunks(iteration, (state, inputs), iterations, chunk)
  out = jnp.swapaxes(buffer, 0, 1).reshape(b, length, emb)
  return out, _per_layer(sown, valid, repeat, s, m, r, lps)


def iterations_per_checkpoint(config: Config, iterations: int, weight_units: float) -> int:
  """k, the pipeline iterations per rematerialisation checkpoint (the module docstring says why); 1 (each
  iteration's stage its own checkpoint) without remat.

  In units of one stage input per device ([mb, length, embed], as a layer input), the backward pass keeps, with
  k = 1, every iteration's input (T of them) and, during one iteration's backward, its LPS layers' inputs; with
  k > 1, each chunk's carry (the device's stage of the state and the microbatch buffer: 1 + M) for the T / k
  chunks, during one chunk's backward its k iterations' LPS layer inputs each, and a second accumulator of the
  stage's weight gradient (weight_units: the chunk's scan accumulates its own before the scan over chunks adds it
  up). Without that term the k that keeps least is about sqrt(T (M + 1) / LPS): 1 for one repeat of many layers
  per stage (llama2-70b, 2 stages x 40 layers: T = 5, M = 4). Only divisors of T: a shorter last chunk is a second
  loop whose buffers (its inputs' stack, its own weight-gradient accumulator) XLA keeps beside the first's
  (llama2-70b circular, T = 161: 31.65 GiB in chunks of 27 and one of 26, 28.03 GiB in 7 of 23, 30.49 GiB with
  k = 1); a prime T (llama3.1-405b circular, 127) keeps k = 1."""
  if config.remat_policy == "none":
    return 1
  m, lps = config.num_pipeline_microbatches, config.num_layers_per_pipeline_stage

  def kept(k):
    return iterations + lps if k == 1 else iterations // k * (m + 1) + k * lps + weight_units

  return min((k for k in range(1, iterations + 1) if iterations % k == 0), key=kept)


def _scan_in_chunks(iteration, carry, count: int, chunk: int):
  """lax.scan of iteration over t = 0 .. count - 1, each `chunk` consecutive iterations (chunk divides count) one
  checkpoint that keeps only its carry for the backward pass. The same carry and stacked outputs [count, ...] as
  the plain scan (chunk = 1)."""
  if chunk == 1:
    return jax.lax.scan(iteration, carry, jnp.arange(count))
  run_chunk = jax.checkpoint(
    lambda carry, ts: jax.lax.scan(iteration, carry, ts), policy=jax.checkpoint_policies.nothing_saveable
  )
  carry, outs = jax.lax.scan(run_chunk, carry, jnp.arange(count).reshape(count // chunk, chunk))
  return carry, jax.tree_util.tree_map(lambda a: a.reshape(count, *a.shape[2:]), outs)


def _stage(block, p, repeat, x, seg, pos, key, layer_of_stage):
  """One stage's LPS layers of repeat `repeat`: p and layer_of_stage are the stage's [R, LPS, ...] share."""
  if layer_of_stage.shape[0] == 1:
    p = jax.tree_util.tree_map(lambda a: a[0], p)
  else:
    # The repeat's weights by a one-hot sum (exact; a dot could round float32 weights to bfloat16 on TPU): a
    # dynamic index would be a gather over the vmapped stages, which XLA partitions by gathering the FSDP-sharded
    # weights whole.
    p = jax.tree_util.tree_map(lambda a: _pick(a, jnp.arange(layer_of_stage.shape[0]) == repeat), p)
  indices = jax.lax.dynamic_index_in_dim(layer_of_stage, repeat, 0, keepdims=False)
  return apply_layers(block, p, x, seg, pos, indices, key)


# Selection by a one-hot mask [n] along the first axis, elementwise. Their VJPs keep only the mask for the backward
# pass: differentiated as plain jnp.where, each iteration kept the mask broadcast to the buffer's shape (on
# llama3.1-405b's circular schedule, two 16 GiB boolean stacks per device).
@jax.custom_vjp
def _pick(a: jax.Array, one_hot: jax.Array) -> jax.Array:
  """a[i] for the one i set in one_hot, as a masked sum (exact: one term is a[i], the others 0)."""
  return jnp.sum(jnp.where(_along(one_hot, a.ndim), a, 0), axis=0)


def _pick_fwd(a, one_hot):
  return _pick(a, one_hot), one_hot


def _pick_bwd(one_hot, g):
  return jnp.where(_along(one_hot, g.ndim + 1), g[None], 0), None


_pick.defvjp(_pick_fwd, _pick_bwd)


@jax.custom_vjp
def _put(a: jax.Array, row: jax.Array, one_hot: jax.Array) -> jax.Array:
  """a with a[i] = row for the i set in one_hot (a unchanged when none is)."""
  return jnp.where(_along(one_hot, a.ndim), row[None], a)


def _put_fwd(a, row, one_hot):
  return _put(a, row, one_hot), one_hot


def _put_bwd(one_hot, g):
  mask = _along(one_hot, g.ndim)
  return jnp.where(mask, 0, g), jnp.sum(jnp.where(mask, g, 0), axis=0), None


_put.defvjp(_put_fwd, _put_bwd)


def _along(v: jax.Array, ndim: int) -> jax.Array:
  """v [n] shaped [n, 1, ...] to broadcast along the first axis of an ndim-array."""
  return v.reshape(-1, *([1] * (ndim - 1)))


def _per_layer(sown, valid, repeat, s, m, r, lps):
  """What the stages sowed, [iterations, S, LPS, ...] per value, as [layers, ...] in layer order: bubble
  iterations dropped, MEAN_OVER_MICROBATCHES averaged over the microbatches and the rest summed."""
  flat = traverse_util.flatten_dict(sown)
  stages = np.arange(s)
  out = {}
  for path, values in flat.items():
    (value,) = values if isinstance(values, tuple) else (values,)
    mask = valid.reshape(*valid.shape, *([1] * (value.ndim - 2)))
    total = jnp.zeros((r, s, *value.shape[2:]), value.dtype)
    total = total.at[repeat, stages[None, :]].add(jnp.where(mask, value, 0))
    if path[-1] in MEAN_OVER_MICROBATCHES:
      total = total / m
    out[path] = total.reshape(r * s * lps, *value.shape[3:])
  return traverse_util.unflatten_dict(out)


def _stage_axes(config: Config):
  return sharding.logical_to_mesh_spec((ct.STAGE,), config)[0]


def _over_stages(p, mesh, config: Config):
  """p [R, S, ...] with its stage dimension over the stage mesh axis, the others left to XLA."""
  unconstrained = jax.sharding.PartitionSpec.UNCONSTRAINED
  spec = jax.sharding.PartitionSpec(None, _stage_axes(config), *([unconstrained] * (p.ndim - 2)))
  return jax.lax.with_sharding_constraint(p, jax.sharding.NamedSharding(mesh, spec))


class Sow(nn.Module):
  """Sows a tree of values {name: value or subtree} under its own path, as the layers would have."""

  @nn.compact
  def __call__(self, tree):
    for name, value in tree.items():
      if isinstance(value, dict):
        Sow(name=name)(value)
      else:
        self.sow("intermediates", name, value)
