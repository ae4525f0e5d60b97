"""Chat with a served model through OpenAI's client, against transformers' greedy answers on the source folder.

    python3 end_to_end/real_model_chat.py --url http://127.0.0.1:PORT --hf DIR [--max-tokens 64] [--questions N]
        [--clients 1 8]

Each question goes to the server's chat route as one user turn (temperature 0, `--max-tokens`); transformers
renders the same turn with the folder's own chat template (apply_chat_template) and generates greedily with the
folder's generation_config.json (its end ids). Prints each pair and "chat: K of N answers equal transformers'
greedy answers, token for token" (the text and the token count). Then, for each count in --clients, that many
clients ask all questions at once, again and again for the same total, and it prints the server's output
tokens/s ("serving: C clients: T output tokens in S s = R tokens/s"). With --perplexity it also prints the served
model's perplexity on some prose that ships with Python (texts(), through echoed prompt logprobs). Exit 1 when an
answer differs, unless --allow-different (a quantized model's answers may).
"""

import argparse
import concurrent.futures
import sys
import time

QUESTIONS = (
  "What is the capital of France?",
  "Name the three primary colors.",
  "Write a haiku about the sea.",
  "What is 12 times 7?",
  "Explain photosynthesis in one sentence.",
  "How do you say 'good morning' in Spanish?",
  "What is the largest planet in the solar system?",
  "Give me a tip for sleeping better.",
)


def transformers_answers(folder: str, questions, max_tokens: int) -> list[tuple[str, int]]:
  """(text, token count without the end token) of transformers' greedy answer to each question."""
  import torch
  import transformers

  tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
  model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
  ends = model.generation_config.eos_token_id
  ends = set(ends if isinstance(ends, list) else [ends])
  answers = []
  for question in questions:
    ids = tokenizer.apply_chat_template(
      [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    with torch.no_grad():
      out = model.generate(ids, do_sample=False, max_new_tokens=max_tokens)[0, ids.shape[1] :].tolist()
    out = out[:-1] if out and out[-1] in ends else out
    answers.append((tokenizer.decode(out, skip_special_tokens=True), len(out)))
  return answers


def texts() -> list[str]:
  """Held-out English prose that ships with Python, 600 characters (about 130 tokens) of each: the Zen of Python,
  heapq's essay on heaps, and the documentation of json and unittest (a model of the web has read them, but they are
  no chat)."""
  import codecs
  import contextlib
  import heapq
  import io
  import json
  import unittest

  with contextlib.redirect_stdout(io.StringIO()):  # (`import this` prints it)
    import this
  paragraphs = [codecs.decode(this.s, "rot13"), heapq.__about__, json.__doc__, unittest.__doc__]
  return [" ".join(p.split())[:600].rsplit(" ", 1)[0] for p in paragraphs]


def perplexity(client, model: str) -> tuple[float, int]:
  """(exp of the mean negative log-likelihood, token count) of texts() by the server's echoed prompt logprobs (the
  first token of each text has none), as lm-eval's loglikelihood requests read them."""
  import math

  total, count = 0.0, 0
  for text in texts():
    out = client.completions.create(model=model, prompt=text, max_tokens=1, echo=True, logprobs=0, temperature=0)
    prompt = out.choices[0].logprobs.token_logprobs[1:-1]  # (the last is the generated token's)
    total, count = total - sum(prompt), count + len(prompt)
  return math.exp(total / count), count


def ask(client, model: str, question: str, max_tokens: int) -> tuple[str, int]:
  chat = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": question}], max_tokens=max_tokens, temperature=0
  )
  return chat.choices[0].message.content, chat.usage.completion_tokens


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--url", required=True)
  parser.add_argument("--hf", required=True, help="the Hugging Face folder the served checkpoint was imported from")
  parser.add_argument("--max-tokens", type=int, default=64)
  parser.add_argument("--questions", type=int, default=len(QUESTIONS))
  parser.add_argument("--clients", type=int, nargs="*", default=[1, 8])
  parser.add_argument("--perplexity", action="store_true", help="also the perplexity of texts()")
  parser.add_argument("--allow-different", action="store_true", help="exit 0 even when answers differ (int8w)")
  args = parser.parse_args()
  import openai

  client = openai.OpenAI(base_url=f"{args.url}/v1", api_key="none", max_retries=0, timeout=600)
  model = client.models.list().data[0].id
  questions = QUESTIONS[: args.questions]
  served = [ask(client, model, q, args.max_tokens) for q in questions]
  began = time.time()
  reference = transformers_answers(args.hf, questions, args.max_tokens)
  print(f"transformers: {len(questions)} greedy answers in {time.time() - began:.1f} s")
  same = 0
  for question, (text, count), (want, want_count) in zip(questions, served, reference, strict=True):
    equal = text == want and count == want_count
    same += equal
    print(f"Q: {question}\n  served ({count} tokens): {text!r}\n  transformers ({want_count}): {want!r}  "
          f"{'same' if equal else 'DIFFERENT'}")  # fmt: skip
  print(f"chat: {same} of {len(questions)} answers equal transformers' greedy answers, token for token")
  if args.perplexity:
    value, count = perplexity(client, model)
    print(f"perplexity: {value:.4f} over {count} tokens of {len(texts())} texts (Python's own documentation)")

  for clients in args.clients:
    jobs = [questions[i % len(questions)] for i in range(max(clients, len(questions)))]
    began = time.time()
    with concurrent.futures.ThreadPoolExecutor(clients) as pool:
      counts = [c for _, c in pool.map(lambda q: ask(client, model, q, args.max_tokens), jobs)]
    seconds = time.time() - began
    rate = sum(counts) / seconds
    print(f"serving: {clients} clients: {sum(counts)} output tokens in {seconds:.1f} s = {rate:.1f} tokens/s")
  return 0 if same == len(questions) or args.allow_different else 1


if __name__ == "__main__":
  sys.exit(main())
