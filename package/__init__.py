"""rollstream: a fully-async rollout pipeline for LLM reinforcement learning on Redis Streams.

The trainer imports ``rollstream.consumer``; producers run ``rollstream.producer``; both build on
``rollstream.common``. ``rollstream.ops`` holds the operator functions, ``rollstream.testing`` the
simulator and embedded Redis, ``rollstream.cli`` the ``rollstream`` command.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("rollstream")
    """The installed distribution's version: pyproject.toml is the single source."""
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["__version__"]
