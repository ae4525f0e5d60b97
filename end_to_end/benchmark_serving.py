"""Serving benchmark: a closed-loop load of C concurrent clients against serve.py, beside decode.py's batches.

    python3 end_to_end/benchmark_serving.py [--quick] [--out DIR] [--concurrency 1,4,16,64] [--requests N]
                                            [--checkpoint ITEMS] [--stream-interval-ms MS] [--no-decode-py]
    python3 end_to_end/benchmark_serving.py --engine-streaming 0,20,50 [--checkpoint ITEMS]

The demo model (configs/demo.yml) with random weights (one training step from a random init, unless --checkpoint
names an `items` folder), in float32 (on the CPU float32 dots run a 16-row decode step 2.6x faster than bfloat16's),
prompts up to 128 tokens and up to 256 in all. The workload is seeded: N requests of random token-id prompts
(8 to 96 tokens) and random output lengths (16 to 128 tokens, generated past EOS: `ignore_eos`), greedy.

For each C, C client threads each send the next request of the workload as soon as their last one finished
(POST /v1/completions, streamed), until every request is answered; one server, with max(C) slots, serves them
all. Printed per C: output tokens/s over the wall time, time to first token (send -> first streamed chunk) and
inter-token latency (a request's (last chunk - first chunk) / (tokens - 1)), p50 and p99, the gap between
streamed chunks (p50, p99, and each stream's longest gap, p50 and p99) and the tokens per chunk (the stream's
smoothness: 1 is every token as it is made). Then decode.py on the same prompts (as text: the tokenizer's decoding
of each prompt), in batches of C, generating 128 tokens each: its own printed tokens/s (generate time only,
prefill excluded). Each C runs once unmeasured first, so compiles are not timed. Results also go to
OUT/serving.json. --stream-interval-ms passes serve.py's stream_interval_ms (0: whole dispatches, as before it
existed); --no-decode-py leaves decode.py out.
--engine-streaming MS,...: the engine alone instead, in this process (no HTTP): for each stream_interval_ms, 1 and
then 4 streamed requests at once (the workload's first prompts, 128 tokens each past EOS): output tokens/s (the
best of 7 runs, since other load on the machine only slows a run down, and the median; the settings take turns
within each round) and the gaps between a request's updates (p50, p99) and tokens per update, over all 7 runs.
--quick (CI, about a minute): C = 1 and 4, 8 requests of at most 24 tokens.
"""

import argparse
import concurrent.futures
import http.client
import json
import os
import re
import subprocess
import sys
import threading
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_PROMPT, MAX_LENGTH = 128, 256
MODEL = ["dtype=float32", f"max_prefill_predict_length={MAX_PROMPT}", f"max_target_length={MAX_LENGTH}"]


def run(args: list[str], **kw) -> str:
  result = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, check=False, **kw)
  if result.returncode != 0:
    sys.exit(f"error: {' '.join(args[:2])} failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
  return result.stdout + result.stderr


def random_checkpoint(out: str) -> str:
  """One training step of the demo model from a random init: its checkpoint's items folder."""
  items = os.path.join(out, "random", "checkpoints", "1", "items")
  if not os.path.isdir(items):
    print("== the demo model, random weights (one training step)", flush=True)
    run(["MaxText/train.py", "MaxText/configs/demo.yml", "run_name=random", f"base_output_directory={out}", "steps=1",
         "dataset_type=synthetic", "eval_interval=-1", "enable_tensorboard=false", "per_device_batch_size=1",
         "log_config=false"])  # fmt: skip
  return items


def workload(n: int, vocab: int, max_out: int, seed: int = 0) -> list[tuple[list[int], int]]:
  rng = np.random.default_rng(seed)
  return [(rng.integers(3, vocab, int(rng.integers(8, 97))).tolist(), int(rng.integers(16, max_out + 1))) for _ in range(n)]


class Server:
  """serve.py in a subprocess on a free loopback port."""

  def __init__(self, items: str, slots: int, out: str, extra: tuple[str, ...] = ()):
    args = [sys.executable, "MaxText/serve.py", "MaxText/configs/demo.yml", f"load_parameters_path={items}",
            f"per_device_batch_size={slots}", "server_port=0", "served_model_name=demo",
            f"server_max_queue={4 * slots}", *MODEL, *extra]  # fmt: skip
    self.log = open(os.path.join(out, f"server_{slots}.log"), "w")  # noqa: SIM115 (closed in stop)
    self.process = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 600
    self.port = None
    for line in self.process.stdout:
      self.log.write(line)
      found = re.search(r"Serving .* at http://127\.0\.0\.1:(\d+)", line)
      if found:
        self.port = int(found.group(1))
        break
      if time.monotonic() > deadline:
        break
    if self.port is None:
      self.stop()
      sys.exit(f"error: serve.py did not start; see {self.log.name}")
    threading.Thread(target=self._drain, daemon=True).start()

  def _drain(self):
    for line in self.process.stdout:
      self.log.write(line)

  def stop(self):
    self.process.terminate()
    try:
      self.process.wait(timeout=60)
    except subprocess.TimeoutExpired:
      self.process.kill()
    self.log.close()


def complete(port: int, prompt: list[int], max_tokens: int) -> dict:
  """One streamed completion: the send time, each chunk's arrival time and the number of tokens generated."""
  body = {"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
          "ignore_eos": True, "stream_options": {"include_usage": True}}  # fmt: skip
  connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
  sent = time.perf_counter()
  connection.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
  response = connection.getresponse()
  if response.status != 200:
    raise RuntimeError(f"HTTP {response.status}: {response.read()[:300]!r}")
  chunks, tokens = [], 0
  for raw in response:
    line = raw.decode().strip()
    if not line.startswith("data: ") or line == "data: [DONE]":
      continue
    event = json.loads(line[len("data: ") :])
    if event.get("choices"):
      chunks.append(time.perf_counter())
    if event.get("usage"):
      tokens = event["usage"]["completion_tokens"]
  connection.close()
  return {"sent": sent, "chunks": chunks, "tokens": tokens}


def load(port: int, requests: list, clients: int) -> dict:
  """A closed loop of `clients` threads over `requests`: throughput and latencies."""
  pending = iter(requests)
  lock = threading.Lock()
  results = []

  def client():
    while True:
      with lock:
        item = next(pending, None)
      if item is None:
        return
      results.append(complete(port, *item))

  start = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(clients) as pool:
    for future in [pool.submit(client) for _ in range(clients)]:
      future.result()
  wall = time.perf_counter() - start
  ttft = [r["chunks"][0] - r["sent"] for r in results]
  itl = [(r["chunks"][-1] - r["chunks"][0]) / (r["tokens"] - 1) for r in results if r["tokens"] > 1]
  gaps = [b - a for r in results for a, b in zip(r["chunks"], r["chunks"][1:], strict=False)]
  longest = [max(b - a for a, b in zip(r["chunks"], r["chunks"][1:], strict=False)) for r in results if len(r["chunks"]) > 1]
  tokens = sum(r["tokens"] for r in results)
  chunks = sum(len(r["chunks"]) for r in results)
  expected = sum(n for _, n in requests)
  if tokens != expected:
    raise RuntimeError(f"the server generated {tokens} tokens where {expected} were asked for")
  ms = lambda xs, q: float(np.percentile(xs, q) * 1e3) if xs else float("nan")  # noqa: E731
  return {"clients": clients, "requests": len(results), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
          "ttft_p50_ms": ms(ttft, 50), "ttft_p99_ms": ms(ttft, 99), "itl_p50_ms": ms(itl, 50), "itl_p99_ms": ms(itl, 99),
          "chunk_gap_p50_ms": ms(gaps, 50), "chunk_gap_p99_ms": ms(gaps, 99), "longest_gap_p50_ms": ms(longest, 50),
          "longest_gap_p99_ms": ms(longest, 99), "tokens_per_chunk": tokens / chunks}  # fmt: skip


def decode_py(items: str, prompts: list[list[int]], batch: int, out: str, max_tokens: int) -> dict:
  """decode.py on the same prompts (as text), in batches of `batch`: its printed generate figures."""
  sys.path.insert(0, REPO)
  from MaxText.input_pipeline import tokenizer as tokenizer_lib  # noqa: PLC0415

  tokenizer = tokenizer_lib.load(os.path.expanduser("~/maxtext_data/demo/tokenizer.model"), "sentencepiece")
  texts = [re.sub(r"\s+", " ", tokenizer.decode(p)).strip() or "x" for p in prompts]
  path = os.path.join(out, "prompts.txt")
  with open(path, "w", encoding="utf-8") as f:
    f.write("\n".join(texts) + "\n")
  length = MAX_PROMPT + max_tokens
  text = run(["MaxText/decode.py", "MaxText/configs/demo.yml", f"load_parameters_path={items}",
              f"decode_prompts_file={path}", f"per_device_batch_size={batch}", "decode_sampling_strategy=greedy",
              "dtype=float32", f"max_prefill_predict_length={MAX_PROMPT}", f"max_target_length={length}"])  # fmt: skip
  found = re.search(r"generate: (\d+) steps? in ([\d.]+) s, ([\d.]+) ms per generated token, ([\d.]+) tokens/s", text)
  if not found:
    sys.exit(f"error: decode.py printed no generate figures:\n{text[-2000:]}")
  steps, seconds, ms, per_second = found.groups()
  return {"batch": batch, "steps": int(steps), "seconds": float(seconds), "ms_per_step": float(ms),
          "tokens_per_s": float(per_second)}  # fmt: skip


def engine_streaming(items: str, intervals: list[float], prompts: list[list[int]], repeats: int = 7) -> list[dict]:
  """The engine alone (see the module docstring): one row per (interval, requests at once). The settings take
  turns within each of the `repeats` rounds, so that the machine's changing load falls on all of them alike."""
  import jax  # noqa: PLC0415

  sys.path.insert(0, REPO)
  from MaxText import pyconfig  # noqa: PLC0415
  from MaxText.inference import engine as engine_lib  # noqa: PLC0415

  keys = [f"load_parameters_path={items}", "run_name=bench", "per_device_batch_size=4", "log_config=false", *MODEL]
  config = pyconfig.load([os.path.join(REPO, "MaxText/configs/demo.yml"), *keys], jax.device_count(), env={})
  engine, _ = engine_lib.Engine.from_config(config)
  settings = [(interval, clients) for interval in intervals for clients in (1, 4)]
  best, gaps, sizes = ({key: [] for key in settings} for _ in range(3))
  for run in range(repeats + 1):  # the first unmeasured: compiles, and times each shape's step
    for interval, clients in settings:
      engine.stream_interval = interval / 1e3
      times = [[] for _ in range(clients)]
      for i in range(clients):
        request = engine_lib.Request(tuple(prompts[i]), 128, ignore_eos=True, stream=True)
        engine.submit(request, lambda u, i=i: times[i].append((time.perf_counter(), len(u.tokens))))
      start = time.perf_counter()
      while engine.busy():
        engine.run_once()
      wall = time.perf_counter() - start
      if run:
        best[interval, clients].append(128 * clients / wall)
        gaps[interval, clients] += [b[0] - a[0] for t in times for a, b in zip(t[1:], t[2:], strict=False)]  # no prefill
        sizes[interval, clients] += [n for t in times for _, n in t[1:] if n]
  rows = []
  for interval, clients in settings:
    p50, p99 = (float(np.percentile(gaps[interval, clients], q) * 1e3) for q in (50, 99))
    row = {"stream_interval_ms": interval, "clients": clients, "tokens_per_s": max(best[interval, clients]),
           "tokens_per_s_median": float(np.median(best[interval, clients])), "update_gap_p50_ms": p50,
           "update_gap_p99_ms": p99, "tokens_per_update": float(np.mean(sizes[interval, clients]))}  # fmt: skip
    rows.append(row)
    print(
      f"engine, {clients} streamed, stream_interval_ms={interval:g}: {row['tokens_per_s']:7.1f} tokens/s (best of "
      f"{repeats}; median {row['tokens_per_s_median']:.1f}); update gap p50 {p50:.1f} ms, p99 {p99:.1f} ms; "
      f"{row['tokens_per_update']:.2f} tokens per update",
      flush=True,
    )
  return rows


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--out", default="/tmp/maxtext_serving_bench")
  parser.add_argument("--concurrency", default="1,4,16,64")
  parser.add_argument("--requests", type=int, default=128)
  parser.add_argument("--checkpoint", default="")
  parser.add_argument("--stream-interval-ms", type=float, default=None)
  parser.add_argument("--no-decode-py", action="store_true")
  parser.add_argument("--engine-streaming", default="")
  args = parser.parse_args()
  levels = [int(c) for c in args.concurrency.split(",")]
  requests, max_out = args.requests, 128
  if args.quick:
    levels, requests, max_out = [1, 4], 8, 24
  os.makedirs(args.out, exist_ok=True)
  items = args.checkpoint or random_checkpoint(args.out)
  work = workload(requests, 1024, max_out)
  if args.engine_streaming:
    intervals = [float(ms) for ms in args.engine_streaming.split(",")]
    rows = engine_streaming(items, intervals, [p for p, _ in work])
    with open(os.path.join(args.out, "engine_streaming.json"), "w", encoding="utf-8") as f:
      json.dump({"date": time.strftime("%Y-%m-%d %H:%M"), "load_average": os.getloadavg(), "rows": rows}, f, indent=1)
    return
  report = {"date": time.strftime("%Y-%m-%d %H:%M"), "load_average": os.getloadavg(), "levels": [], "decode_py": []}
  extra = () if args.stream_interval_ms is None else (f"stream_interval_ms={args.stream_interval_ms:g}",)
  server = Server(items, max(levels), args.out, extra)
  try:
    for clients in levels:
      load(server.port, work[: max(clients, 4)], clients)  # unmeasured: compiles this many rows' programs
      result = load(server.port, work, clients)
      report["levels"].append(result)
      print(
        f"C={clients:>3}: {result['tokens_per_s']:8.1f} output tokens/s ({result['tokens']} tokens, "
        f"{result['wall_s']:.1f} s); TTFT p50 {result['ttft_p50_ms']:.0f} ms, p99 {result['ttft_p99_ms']:.0f} ms; "
        f"ITL p50 {result['itl_p50_ms']:.2f} ms, p99 {result['itl_p99_ms']:.2f} ms; chunk gap p50 "
        f"{result['chunk_gap_p50_ms']:.1f} ms, p99 {result['chunk_gap_p99_ms']:.1f} ms; a stream's longest gap p50 "
        f"{result['longest_gap_p50_ms']:.1f} ms, p99 {result['longest_gap_p99_ms']:.1f} ms; "
        f"{result['tokens_per_chunk']:.2f} tokens per chunk",
        flush=True,
      )
  finally:
    server.stop()
  for clients in [] if args.no_decode_py else levels:
    result = decode_py(items, [p for p, _ in work], clients, args.out, max_out)
    report["decode_py"].append(result)
    print(
      f"decode.py batch {clients:>3}: {result['tokens_per_s']:8.1f} tokens/s, {result['ms_per_step']:.2f} ms per "
      f"step ({result['steps']} steps in {result['seconds']:.2f} s; prefill and compile not counted)",
      flush=True,
    )
  one = report["levels"][0]["tokens_per_s"]
  for result in report["levels"][1:]:
    print(f"C={result['clients']}: {result['tokens_per_s'] / one:.2f}x one client's tokens/s")
  with open(os.path.join(args.out, "serving.json"), "w", encoding="utf-8") as f:
    json.dump(report, f, indent=1)


if __name__ == "__main__":
  main()
