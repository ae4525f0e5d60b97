"""OpenAI-compatible HTTP server over the inference engine:
`python3 MaxText/serve.py MaxText/configs/base.yml load_parameters_path=PATH tokenizer_path=PATH [key=value ...]`.

The config keys are decode.py's plus base.yml's serving section (server_host, server_port, server_api_key, ...);
the endpoints and their rules are the server package's (MaxText/server/__init__.py).
"""

import sys

if __package__ in (None, ""):  # Run as a script: see MaxText/script_path.py.
  import script_path  # noqa: F401

from MaxText import cli
from MaxText.server import run


def main(argv) -> int:
  return cli.run_cli(run.serve, argv)


if __name__ == "__main__":
  sys.exit(main(sys.argv))
