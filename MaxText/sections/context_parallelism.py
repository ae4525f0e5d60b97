"""Context parallelism's section (layers/context_parallel.py): how attention runs over sequences split across
devices. What needs the mesh (does the sequence split into 2 x shards chunks?) is config_validate.check_derived's."""

from MaxText.sections import Section

STRATEGIES = ("all_gather", "ring")  # `context_parallel_strategy`

SECTION = Section(
  name="context_parallelism",
  keys=("context_parallel_strategy", "context_parallel_load_balance"),
  choices={"context_parallel_strategy": STRATEGIES},
)
