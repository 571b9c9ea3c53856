"""The package's version, on the ground floor: every layer may read it (provenance), and `import sim` (the face,
sim/__init__.py) re-exports it."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("expertsim")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"
