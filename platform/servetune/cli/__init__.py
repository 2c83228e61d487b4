"""The ``servetune`` command."""

from servetune.cli._main import main

__all__ = ["main"]
