"""The gateway tests import their runtime double (`runtime_double.py`) by name."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
