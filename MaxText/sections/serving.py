"""The server's section (MaxText/server/): where it listens, who may call it, and the sizes and times it accepts."""

from collections.abc import Mapping

from MaxText.common_types import ConfigError
from MaxText.sections import Section


def check(values: Mapping) -> None:
  """ConfigError for a serving key out of range."""
  if not 0 <= values["server_port"] <= 65535:
    raise ConfigError(f"server_port={values['server_port']} is not a TCP port; give 1 to 65535 (0: any free port)")
  if not values["server_host"].strip():
    raise ConfigError("server_host is empty; give the address to listen on, e.g. 127.0.0.1 (this machine only)")
  if values["server_max_queue"] < 1:
    raise ConfigError(f"server_max_queue={values['server_max_queue']} must be at least 1 (requests waiting for a slot)")
  if values["server_max_prompt_chars"] < 1:
    raise ConfigError(
      f"server_max_prompt_chars={values['server_max_prompt_chars']} must be at least 1 (characters of a prompt)"
    )
  if not 0 < values["server_read_timeout"] <= 86400:
    raise ConfigError(
      f"server_read_timeout={values['server_read_timeout']} must be 1 to 86400 seconds (a client's time to send a request)"
    )


SECTION = Section(
  name="serving",
  keys=(
    "server_host",
    "server_port",
    "server_api_key",
    "server_max_queue",
    "server_max_prompt_chars",
    "server_read_timeout",
    "served_model_name",
  ),
  check=check,
)
