"""Supervised fine-tuning (`objective=sft`, MaxText's `use_sft=true`): language modelling on conversations. A record
is a conversation (train_data_columns), rendered with the chat template or plain turns by input_pipeline/sft.py;
the loss is lm's on the tokens its mask keeps (with sft_train_on_completion_only, the assistant turns)."""

from MaxText import input_pipeline
from MaxText.objectives import lm


class SupervisedFineTuning(lm.LanguageModelling):
  """lm's loss and evaluation on conversations (the targets outside the loss have segmentation 0)."""

  name = "sft"
  examples = input_pipeline.CONVERSATIONS
  same_step_as = "lm"  # only the records differ


OBJECTIVE = SupervisedFineTuning
