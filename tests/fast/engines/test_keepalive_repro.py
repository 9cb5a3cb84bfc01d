"""The keep-alive race reproduction's command line. The race itself (a 5 s gap against 5 s keep-alive
engines, and the window the resets land in) is its own slow test: tests/system/test_keepalive_repro.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
TOOL = REPO / "tools" / "fork" / "keepalive_race_repro.py"


def test_help_documents_the_modes() -> None:
    proc = subprocess.run([sys.executable, str(TOOL), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    for word in ("scan", "broadcast", "starved", "base", "fixed", "--gap", "--engine-keepalive"):
        assert word in proc.stdout
