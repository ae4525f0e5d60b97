"""The data pipeline's section (input_pipeline/): where the records come from and which tokenizer reads them."""

from MaxText.sections import Section

TEXT_SOURCES = ("grain", "tfds", "hf")  # the `dataset_type`s of records (input_pipeline.TEXT_SOURCES reads each)
DATASET_TYPES = ("synthetic", *TEXT_SOURCES)  # `dataset_type`
TOKENIZER_TYPES = ("sentencepiece", "tiktoken", "huggingface")  # `tokenizer_type` (input_pipeline.tokenizer.LOADERS)

SECTION = Section(
  name="data",
  keys=("dataset_type", "tokenizer_type"),
  choices={"dataset_type": DATASET_TYPES, "tokenizer_type": TOKENIZER_TYPES},
)
