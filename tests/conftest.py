"""Shared test helpers."""

import os

import pytest


def require(module: str, reason: str):
    """Import MODULE, or skip the calling test module saying REASON; under CI (which installs every extra) a
    missing module fails instead, so a test that CI is meant to run can never silently stop running."""
    try:
        return pytest.importorskip(module, reason=reason)
    except pytest.skip.Exception:
        if os.environ.get("CI"):
            pytest.fail(f"CI is set but {module} is missing: {reason}", pytrace=False)
        raise
