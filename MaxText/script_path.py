"""Makes `import MaxText` work in an entry point run as a file (`python3 MaxText/train.py ...`).

Python puts the script's own folder (MaxText/, or MaxText/tests/) first on sys.path, not the repository root,
so every entry point starts with

    if __package__ in (None, ""):  # Run as a script: see MaxText/script_path.py.
      import script_path  # noqa: F401

which finds this file beside the script (MaxText/tests/script_path.py links here) and puts the repository
root first on sys.path. Imported as part of the package (`python3 -m MaxText.train`, the tests), nothing
needs doing and the entry points skip it.
"""

import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
if sys.path[0] != REPO_ROOT:
  sys.path.insert(0, REPO_ROOT)
