"""expertsim: a discrete-event simulator of MoE expert caches in local LLM inference engines."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("expertsim")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"


def __getattr__(name: str):
    """`sim.run(...)` and `sim.Run` (sim/notebook.py), imported on first use: `import sim`, which every
    `expertsim` command does, stays free of the engines and pandas."""
    if name in ("run", "Run"):
        from sim import notebook

        return getattr(notebook, name)
    raise AttributeError(f"module 'sim' has no attribute {name!r}")
