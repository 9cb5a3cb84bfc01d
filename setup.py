"""Build hook only (everything else is in pyproject.toml): a wheel carries `templates/` and `presets/` as
package data of `launcher` (launcher/templates, launcher/presets), while the repository keeps them at its
top, where they are edited. launcher/shipped.py finds either place.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
SHIPPED_DIRS = ("templates", "presets")  # the same names as launcher.shipped.SHIPPED_DIRS


class BuildPyWithShippedFiles(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return  # an editable install reads them from the checkout
        for name in SHIPPED_DIRS:
            target = Path(self.build_lib) / "launcher" / name
            shutil.rmtree(target, ignore_errors=True)  # a file deleted since the last build must not ship
            shutil.copytree(ROOT / name, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


setup(cmdclass={"build_py": BuildPyWithShippedFiles})
