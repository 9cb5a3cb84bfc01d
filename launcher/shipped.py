"""Where the files the launcher ships live: the job-script templates and the presets.

They are edited at the top of the repository (`templates/`, `presets/`). A wheel carries them inside the
package (`launcher/templates`, `launcher/presets`: setup.py copies them in when it builds), so an
installed launcher finds them as package data and a checkout or an editable install finds them in place.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

SHIPPED_DIRS = ("templates", "presets")


def shipped_dir(name: str) -> Path:
    """The directory of the shipped `templates` or `presets`: the package's copy first, else the checkout's.

    The package's copy wins so that an installed launcher never reads a stray `templates/` that happens to
    sit next to its package in site-packages.
    """
    if name not in SHIPPED_DIRS:
        raise ValueError(f"{name!r} is not shipped with the launcher: one of {', '.join(SHIPPED_DIRS)}")
    package = Path(str(resources.files("launcher")))
    for candidate in (package / name, package.parent / name):
        if candidate.is_dir():
            return candidate
    # neither exists: return the checkout path, so the error a caller raises names where it looked
    return package.parent / name
