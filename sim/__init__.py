"""expertsim: a discrete-event simulator of MoE expert caches in local LLM inference engines."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("expertsim")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"
