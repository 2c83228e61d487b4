"""The ``servetune`` command."""

from servetune.cli.main import main

__all__ = ["main"]
