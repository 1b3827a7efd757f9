"""Fixtures shared by the tests.

mpidl reads its environment variables once, in :mod:`mpidl.settings` (``SETTINGS``, when that
module is first imported), so setting one inside a test process changes nothing. A test never
sets one for the product: it uses the explicit API (``with kernels.use("reference")``,
``Conv2d(..., algorithm="winograd")``) or, to check what a variable does, replaces the
settings with :func:`mpidl_settings`. Only a test that starts ``python -m mpidl.train`` (or
another command line) in a child process passes a variable, in the child's environment, as a
user would.
"""

from __future__ import annotations

import pytest

from mpidl import settings


@pytest.fixture
def mpidl_settings(monkeypatch):
    """``mpidl_settings(MPIDL_KERNELS="reference")`` makes :data:`mpidl.settings.SETTINGS`, for
    the rest of this test, what mpidl would have read from an environment holding only the
    variables given (``mpidl_settings()``: none set, whatever the environment of the test run
    says); returns the new :class:`mpidl.settings.Settings`. The previous one is back after
    the test."""

    def replace(**environ: str) -> settings.Settings:
        unknown = sorted(set(environ) - set(settings.ENVIRONMENT))
        if unknown:
            raise ValueError(f"mpidl_settings: {unknown} not in mpidl.settings.ENVIRONMENT")
        new = settings.Settings.from_environ(environ)
        monkeypatch.setattr(settings, "SETTINGS", new)
        return new

    return replace
