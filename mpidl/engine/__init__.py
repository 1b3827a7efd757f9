"""The engine: arrays (backend), the flat parameter buffer, layers (nn), models, optimizers,
and the thread policy. Nothing here imports MPI."""
