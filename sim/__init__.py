"""expertsim: a discrete-event simulator of MoE expert caches in local LLM inference engines.

The package's face: `sim.__version__`, and `sim.run(...)` / `sim.Run` (sim/notebook.py) imported on first use, so
that `import sim`, which every `expertsim` command does, stays free of the engines and pandas."""

from sim.version import __version__


def __getattr__(name: str):
    if name in ("run", "Run"):
        from sim import notebook

        return getattr(notebook, name)
    raise AttributeError(f"module 'sim' has no attribute {name!r}")


__all__ = ["__version__", "run", "Run"]
