"""What the server takes from the config (its keys' rules are its section's, sections/serving.py, checked when the
config is read): the served model's name, and the app's `Options` (which tests build directly)."""

import dataclasses

from MaxText import chat_template
from MaxText.common_types import Config


def served_name(config: Config) -> str:
  """served_model_name, else run_name, else the run folder of load_parameters_path (.../RUN/checkpoints/STEP/items)."""
  if config.served_model_name:
    return config.served_model_name
  if config.run_name:
    return config.run_name
  parts = [p for p in config.load_parameters_path.replace("\\", "/").split("/") if p]
  while parts and (parts[-1] in ("items", "checkpoints") or parts[-1].isdigit()):
    parts.pop()
  return parts[-1] if parts else "maxtext"


@dataclasses.dataclass(frozen=True)
class Options:
  """What the app needs of the config (tests build one directly)."""

  model_name: str
  api_key: str = ""
  add_bos: bool = True
  chat_template: str = chat_template.FALLBACK_TEMPLATE  # Jinja text, as chat_template.find_template gives it
  max_prompt_chars: int = 1_000_000  # server_max_prompt_chars
  read_timeout: float = 30.0  # server_read_timeout: seconds for a request's headers, and again for its body

  @classmethod
  def from_config(cls, config: Config) -> "Options":
    template, _ = chat_template.find_template(config.chat_template, config.chat_template_path, config.tokenizer_path)
    return cls(
      served_name(config),
      config.server_api_key,
      config.add_bos,
      template,
      config.server_max_prompt_chars,
      config.server_read_timeout,
    )
