"""mpidl: a pure-MPI, from-scratch data-parallel deep learning framework.

``mpidl.kernels`` and ``mpidl.data_tools`` are the top-level ``kernels/`` and ``data_tools/``
folders, mapped by pyproject.toml's ``package-dir``: install the checkout (``pip install -e
.``) to import them.
"""

__version__ = "0.1.0"
