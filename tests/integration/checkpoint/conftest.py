"""Checkpoint integration tests: make the harness and worker importable.

The worker runs as a script in its own processes; the tests import the
harness by module name, so this folder goes on sys.path (the tests tree has
no packages).
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).parent))
