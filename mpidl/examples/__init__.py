"""Runnable examples of the public API (``python -m mpidl.examples.<name>``)."""
