"""forward_pass_logit_checker.py against golden logits written by generate_hf_golden_logits.py (float32, CPU).

A random transformers model is saved and imported (hf_checkpoint_test's helpers); its golden logits pass at
atol = rtol = 1e-4 (float32 on both sides agree to within 4e-6 here) and KL <= 1e-8 (1e-12 here). The same
file altered so that the two no longer agree fails with exit code 1; a malformed file is one line and exit code 2.
"""

import json
import os
import sys

import numpy as np
import pytest

from MaxText import generate_hf_golden_logits
from MaxText.tests import forward_pass_logit_checker as checker
from MaxText.tests.helpers import BASE_YML

pytest.importorskip("torch")
pytest.importorskip("transformers")

from MaxText.tests.hf_checkpoint_test import import_hf, save_random  # noqa: E402

TOKEN_IDS = ["5,17,3,88,41,9,60,2,33,71,12", "1,95,40,7"]  # 11 tokens: past gemma2's sliding window of 5
TIGHT = ["--atol=1e-4", "--rtol=1e-4", "--max_kl_div=1e-8"]


@pytest.fixture(scope="module", params=["llama", "gemma2"])
def golden(request, tmp_path_factory):
  """(checker argv without flags, golden file) of a random imported model of each family."""
  tmp = tmp_path_factory.mktemp(request.param)
  save_random(request.param, str(tmp / "hf"))
  ckpt = import_hf(str(tmp / "hf"), str(tmp / "out"))
  path = str(tmp / "golden.jsonl")
  argv = ["gen", f"--hf_model_path={tmp / 'hf'}", f"--output_path={path}", "--token_ids", *TOKEN_IDS]
  assert generate_hf_golden_logits.main(argv) == 0
  config = [
    "check",
    BASE_YML,
    f"model_name={os.path.join(ckpt, 'model.yml')}",
    f"load_parameters_path={os.path.join(ckpt, 'items')}",
    "dtype=float32",
    "matmul_precision=highest",
    "jax_cache_dir=",
    "max_target_length=32",
  ]
  return config, path


def rewrite(path, out, edit):
  """Writes the golden file at `path` to `out` with edit(row) applied to each row."""
  with open(path) as f:
    rows = [json.loads(line) for line in f]
  with open(out, "w") as f:
    f.writelines(json.dumps(edit(row)) + "\n" for row in rows)
  return out


def run(config, path, *flags, capsys=None):
  code = checker.main([*config, f"--golden_logits_path={path}", *flags])
  return code, (capsys.readouterr() if capsys else None)


def test_golden_logits_pass_and_altered_ones_fail(golden, tmp_path, capsys):
  config, path = golden
  code, out = run(config, path, *TIGHT, capsys=capsys)
  assert code == 0, out.err
  assert "All 2 prompts match" in out.out and out.out.count("max |diff|") == 2

  def bump(row):  # one logit of one position of the first prompt, +0.5
    if len(row["tokens"]) == 11:
      row["logits"][6][40] += 0.5
    return row

  code, out = run(config, rewrite(path, tmp_path / "bump.jsonl", bump), *TIGHT, capsys=capsys)
  assert code == 1 and out.err.count("\n") == 1
  assert "prompt 0" in out.err and "position 6" in out.err and "logit 40" in out.err, out.err

  # Two tokens swapped: the logits no longer belong to the input (every position sees different tokens).
  swapped = rewrite(
    path, tmp_path / "swap.jsonl", lambda r: {**r, "tokens": [r["tokens"][1], r["tokens"][0], *r["tokens"][2:]]}
  )
  assert run(config, swapped)[0] == 1  # caught even at the default atol = rtol = 0.1

  # Every logit x 1.05 is within rtol=0.1, so only the KL divergence (4e-4 to 2e-3 here) catches it.
  scaled = rewrite(path, tmp_path / "scaled.jsonl", lambda r: {**r, "logits": (np.asarray(r["logits"]) * 1.05).tolist()})
  assert run(config, scaled, "--atol=0", "--rtol=0.1")[0] == 0
  code, out = run(config, scaled, "--atol=0", "--rtol=0.1", "--max_kl_div=1e-5", capsys=capsys)
  assert code == 1 and "KL(golden || ours)" in out.err, out.err


@pytest.mark.parametrize(
  "content, flags, message",
  [
    (None, [], "does not exist"),
    ('{"tokens": [1, 2], "logits": [[0.0]]\n', [], "line 1 is not a JSON object"),
    ('{"prompt": "x", "tokens": [1, 2]}\n', [], "line 1 is not a JSON object"),
    ('{"tokens": [1, 2], "logits": [[0.0, 1.0]]}\n', [], "want tokens [n]"),
    ('{"tokens": 3, "logits": [[0.0, 1.0]]}\n', [], "want tokens [n]"),
    ("\n" + json.dumps({"tokens": [1], "logits": [[0.0] * 95]}), [], "line 2: the logits have vocab 95"),
    (json.dumps({"tokens": [1, 96], "logits": [[0.0] * 96] * 2}), [], "token 96 is outside the vocabulary [0, 96)"),
    (json.dumps({"tokens": [1], "logits": [[0.0] * 96]}), ["--atol=big"], "'big' is not a number"),
    (json.dumps({"tokens": [1], "logits": [[0.0] * 96]}), ["--tolerance=1"], "unknown flag --tolerance=1"),
  ],
  ids=["missing", "bad_json", "no_logits", "shapes", "scalar_tokens", "vocab", "token_range", "bad_number", "unknown_flag"],
)
def test_user_mistakes_are_one_line_and_exit_2(golden, tmp_path, capsys, content, flags, message):
  config, _ = golden
  path = tmp_path / "golden.jsonl"
  if content is not None:
    path.write_text(content)
  code, out = run(config, path, *flags, capsys=capsys)
  assert code == 2 and out.err.startswith("error: ") and out.err.count("\n") == 1 and message in out.err, out.err


def test_missing_golden_flag(golden, capsys):
  assert checker.main(golden[0]) == 2 and "--golden_logits_path=FILE is missing" in capsys.readouterr().err


def test_generator_mistakes(tmp_path, capsys):
  save_random("llama", str(tmp_path / "hf"))
  argv = ["gen", f"--hf_model_path={tmp_path / 'hf'}", f"--output_path={tmp_path / 'g.jsonl'}"]
  assert generate_hf_golden_logits.main([*argv, "--token_ids", "1,96"]) == 2
  assert "in [0, 96)" in capsys.readouterr().err
  assert generate_hf_golden_logits.main([*argv, "--prompts", "hello"]) == 2  # a random model has no tokenizer
  assert "pass --token_ids" in capsys.readouterr().err
  assert not os.path.exists(tmp_path / "g.jsonl")


def test_generator_without_the_test_stack_is_one_line(tmp_path, capsys, monkeypatch):
  """transformers comes with `setup.sh --dev` only: without it the generator says so in one line."""
  (tmp_path / "hf").mkdir()
  (tmp_path / "hf" / "config.json").write_text("{}")
  monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now raises ImportError
  argv = ["gen", f"--hf_model_path={tmp_path / 'hf'}", f"--output_path={tmp_path / 'g.jsonl'}", "--token_ids", "1"]
  assert generate_hf_golden_logits.main(argv) == 2
  err = capsys.readouterr().err
  assert err == (
    "error: transformers is not installed (it comes with the test stack); run: bash setup.sh --dev (PyTorch: on "
    "Python 3.11)\n"
  ), err
