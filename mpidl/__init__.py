"""mpidl: a pure-MPI, from-scratch data-parallel deep learning framework."""

import os as _os

# In a source checkout, kernels/ and data_tools/ sit beside mpidl/ and are installed as
# mpidl.kernels and mpidl.data_tools (see pyproject.toml). Adding the checkout root to this
# package's search path makes `import mpidl.kernels` work from the checkout too, with or
# without an editable install, so `python -m mpidl.train` behaves the same everywhere.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "kernels", "__init__.py")):
    __path__.append(_root)  # type: ignore[name-defined]

__version__ = "0.1.0"

# The thread policy (mpidl/threads.py): OpenMP's idle workers sleep instead of spinning. Set
# here, before Numba loads libgomp; the thread counts follow when a model is built.
from mpidl import threads as _threads  # noqa: E402

_threads.set_wait_policy()
# Freed array memory stays in the process (glibc), so each step does not page-fault it back in.
_threads.set_malloc_policy()
