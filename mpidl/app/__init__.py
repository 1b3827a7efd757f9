"""The application layer: the classification loop (trainer), its configuration, checkpoints,
logs, metrics and output files. The commands (``python -m mpidl.train`` ...) are its entry points."""
