"""`python -m launcher` is the `launcher` console script."""

from launcher.cli import main

main()
