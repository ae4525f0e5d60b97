"""Peak memory of importing a large Hugging Face checkpoint: it must stay far below the checkpoint's size.

    python3 end_to_end/hf_import_memory.py [--workdir /tmp/hf_import_memory] [--layers 20] [--scan_layers true] [--quick]

Writes a random Llama-shaped float32 checkpoint (emb 2048, 16 heads over 4 KV heads, MLP 5632, vocab 32000;
20 layers is 4.1 GB) as 1 GB safetensors shards, imports it with convert_hf_checkpoint.py under
`/usr/bin/time -v`, and prints the importer's peak RSS as a fraction of the checkpoint's size (target < 30%).
It then checks one layer's query weights in the output against the source.

--quick (CI, about 2 s): a 2-layer model of emb 256 and vocab 4096 (14 MB) in 4 shards of up to 4 MB: the same
streamed, sharded import and the same check of the weights, without the memory target (the importer's own 0.3 GB
dwarfs so small a checkpoint).
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FULL = dict(EMB=2048, HEADS=16, KV=4, HEAD_DIM=128, MLP=5632, VOCAB=32000)
QUICK = dict(EMB=256, HEADS=4, KV=2, HEAD_DIM=64, MLP=704, VOCAB=4096)
EMB, HEADS, KV, HEAD_DIM, MLP, VOCAB = FULL.values()


def tensors(layers: int):
  """(name, shape) of every tensor, in file order."""
  yield "model.embed_tokens.weight", (VOCAB, EMB)
  for i in range(layers):
    p = f"model.layers.{i}."
    yield p + "input_layernorm.weight", (EMB,)
    yield p + "self_attn.q_proj.weight", (HEADS * HEAD_DIM, EMB)
    yield p + "self_attn.k_proj.weight", (KV * HEAD_DIM, EMB)
    yield p + "self_attn.v_proj.weight", (KV * HEAD_DIM, EMB)
    yield p + "self_attn.o_proj.weight", (EMB, HEADS * HEAD_DIM)
    yield p + "post_attention_layernorm.weight", (EMB,)
    yield p + "mlp.gate_proj.weight", (MLP, EMB)
    yield p + "mlp.up_proj.weight", (MLP, EMB)
    yield p + "mlp.down_proj.weight", (EMB, MLP)
  yield "model.norm.weight", (EMB,)
  yield "lm_head.weight", (VOCAB, EMB)


def write_checkpoint(folder: str, layers: int, shard_bytes: int = 10**9) -> int:
  from safetensors.numpy import save_file

  os.makedirs(folder)
  config = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": EMB,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV,
    "head_dim": HEAD_DIM,
    "intermediate_size": MLP,
    "num_hidden_layers": layers,
    "vocab_size": VOCAB,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
  }
  with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump(config, f)
  rng = np.random.default_rng(0)
  shard, size, total, names, weight_map = {}, 0, 0, [], {}

  def flush():
    nonlocal shard, size
    name = f"model-{len(names) + 1:05d}.safetensors"
    save_file(shard, os.path.join(folder, name), metadata={"format": "pt"})
    names.append(name)
    weight_map.update(dict.fromkeys(shard, name))
    shard, size = {}, 0

  for name, shape in tensors(layers):
    array = rng.standard_normal(shape, dtype=np.float32) * 0.02
    if size and size + array.nbytes > shard_bytes:
      flush()
    shard[name] = array
    size += array.nbytes
    total += array.nbytes
  flush()
  with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
  return total


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--workdir", default="/tmp/hf_import_memory")
  parser.add_argument("--layers", type=int, default=20)
  parser.add_argument("--scan_layers", default="true")
  parser.add_argument("--quick", action="store_true", help="a 14 MB model in 4 MB shards; no memory target")
  args = parser.parse_args()
  shard_bytes = 10**9
  if args.quick:
    global EMB, HEADS, KV, HEAD_DIM, MLP, VOCAB
    EMB, HEADS, KV, HEAD_DIM, MLP, VOCAB = QUICK.values()
    args.layers, shard_bytes = 2, 4 * 10**6
  shutil.rmtree(args.workdir, ignore_errors=True)
  hf = os.path.join(args.workdir, "hf")
  print(f"writing a random {args.layers}-layer checkpoint to {hf} ...", flush=True)
  total = write_checkpoint(hf, args.layers, shard_bytes)
  print(f"checkpoint: {total / 1e9:.2f} GB ({total} bytes) in {len(os.listdir(hf)) - 2} shards", flush=True)

  command = [
    "/usr/bin/time",
    "-v",
    sys.executable,
    os.path.join(REPO, "MaxText", "convert_hf_checkpoint.py"),
    os.path.join(REPO, "MaxText", "configs", "base.yml"),
    f"hf_model_path={hf}",
    f"base_output_directory={args.workdir}",
    "run_name=imported",
    f"scan_layers={args.scan_layers}",
    "jax_cache_dir=",
  ]
  print("importing it with convert_hf_checkpoint.py under /usr/bin/time -v ...", flush=True)
  run = subprocess.run(command, capture_output=True, text=True, check=False)
  if run.returncode:
    print(run.stdout, run.stderr[-3000:])
    return run.returncode
  peak = 1024 * int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", run.stderr).group(1))  # KiB -> bytes
  wall = re.search(r"Elapsed \(wall clock\) time.*: (\S+)", run.stderr).group(1)
  ratio = peak / total
  print(f"importer peak RSS: {peak / 1e9:.2f} GB = {100 * ratio:.1f}% of the checkpoint; wall {wall}", flush=True)

  # One layer's query projection, read back from the Orbax checkpoint, against the source tensor.
  import tensorstore as ts
  from safetensors import safe_open

  layer = args.layers // 2
  source_name = f"model.layers.{layer}.self_attn.q_proj.weight"
  with open(os.path.join(hf, "model.safetensors.index.json")) as f:
    shard = json.load(f)["weight_map"][source_name]
  with safe_open(os.path.join(hf, shard), "numpy") as f:
    want = f.get_tensor(source_name).T.reshape(EMB, HEADS, HEAD_DIM)
  items = os.path.join(args.workdir, "imported", "checkpoints", "0", "items")
  leaf = (
    "params.layers.self_attention.query.kernel"
    if args.scan_layers == "true"
    else f"params.layers_{layer}.self_attention.query.kernel"
  )
  spec = {"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": f"file://{items}", "path": leaf}}
  stored = ts.open(spec).result()
  got = stored[layer].read().result() if args.scan_layers == "true" else stored.read().result()
  print(f"layer {layer} query kernel equal to the source: {np.array_equal(got, want)}")
  ok = (args.quick or ratio < 0.30) and np.array_equal(got, want)
  shutil.rmtree(args.workdir, ignore_errors=True)
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
