"""What the server takes from the config: its keys checked (one-line errors), the served model's name, and the
app's `Options` (which tests build directly)."""

import dataclasses

from MaxText import chat_template
from MaxText.common_types import Config, ConfigError


def check(config: Config) -> None:
  """ConfigError for a serving key out of range."""
  if not 0 <= config.server_port <= 65535:
    raise ConfigError(f"server_port={config.server_port} is not a TCP port; give 1 to 65535 (0: any free port)")
  if not config.server_host.strip():
    raise ConfigError("server_host is empty; give the address to listen on, e.g. 127.0.0.1 (this machine only)")
  if config.server_max_queue < 1:
    raise ConfigError(f"server_max_queue={config.server_max_queue} must be at least 1 (requests waiting for a slot)")
  if config.server_max_prompt_chars < 1:
    raise ConfigError(
      f"server_max_prompt_chars={config.server_max_prompt_chars} must be at least 1 (characters of a prompt)"
    )
  if not 0 < config.server_read_timeout <= 86400:
    raise ConfigError(
      f"server_read_timeout={config.server_read_timeout} must be 1 to 86400 seconds (a client's time to send a request)"
    )


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
    check(config)
    template, _ = chat_template.find_template(config.chat_template, config.chat_template_path, config.tokenizer_path)
    return cls(
      served_name(config),
      config.server_api_key,
      config.add_bos,
      template,
      config.server_max_prompt_chars,
      config.server_read_timeout,
    )
