"""The fine-tuning demo's questions: answers from each document's title, held-out questions only from held-out
documents, and the files the demo reads."""

import json

from MaxText import build_finetune_demo_data as demo

CHAPTER = "2 Chronicles 2\n\nAnd Solomon determined to build an house for the name of the LORD. Short one. " + (
  "And Solomon sent to Huram the king of Tyre, saying, As thou didst deal with David my father. "
  "Behold, I build an house to the name of the LORD my God, to dedicate it to him."
)
SCENE = (
  "Pericles\nACT V\nSCENE III. The temple of Diana at Ephesus.\n\nEnter PERICLES, with his train\n\nPERICLES\n"
  "Hail, Dian! to perform thy just command,\nI here confess myself the king of Tyre;\nShort.\n"
  "Exeunt all but the king of Tyre and his daughter\n"
)
OTHER = "Genesis 1\n\nIn the beginning God created the heaven and the earth, and the earth was without form."


def test_questions_take_their_answer_from_the_document():
  kind, answer, passages = demo.questions(CHAPTER)
  assert (kind, answer) == ("bible", "2 Chronicles") and len(passages) == 3
  assert "Short one." not in passages
  kind, answer, passages = demo.questions(SCENE)
  assert (kind, answer) == ("play", "Pericles")
  assert passages == ["Hail, Dian! to perform thy just command,", "I here confess myself the king of Tyre;"]
  assert demo.questions("A Python document\nabout nothing") == ("", "", [])


def test_held_out_questions_come_only_from_held_out_documents(tmp_path):
  hamlet = SCENE.replace("Pericles", "Hamlet")
  sets = demo.build([CHAPTER, SCENE, hamlet], [OTHER], per_document=(2, 2), seed=1)
  assert len(sets["train"]) == 6 and {k for _, _, k in sets["train"]} == {"source", "bible", "play"}
  for question, answer, kind in sets["train"]:
    if kind == "source":
      assert question.startswith(demo.SOURCE_QUESTION) and answer in ("the Bible", "Shakespeare")
    else:
      assert answer in {"2 Chronicles", "Pericles", "Hamlet"}
  ((question, answer, kind),) = sets["heldout"]
  assert question.endswith(OTHER.split("\n")[2]) and answer in ("Genesis", "the Bible")
  demo.write(str(tmp_path), sets)
  sft = [json.loads(line) for line in open(tmp_path / "sft_train.jsonl", encoding="utf-8")]
  dpo = [json.loads(line) for line in open(tmp_path / "dpo_train.jsonl", encoding="utf-8")]
  assert [r["completion"] for r in sft] == [r["chosen"] for r in dpo]
  kinds = [{"2 Chronicles", "Genesis"}, {"Pericles", "Hamlet"}, {"the Bible", "Shakespeare"}]
  for row in dpo:  # the wrong answer is another answer of the same kind
    assert row["rejected"] != row["chosen"] and any({row["chosen"], row["rejected"]} <= kind for kind in kinds)
  assert (tmp_path / "heldout_answers.txt").read_text() == answer + "\n"
  assert (tmp_path / "heldout_prompts.txt").read_text() == question + "\n"
