# mpiexec -n 4 env MPIDL_INJECT_FAULT=1:5:kill python tests/faulty_train.py [python -m mpidl.train options]
"""``python -m mpidl.train`` with the tests' fault injection (tests/faults.py): the faults of
``MPIDL_INJECT_FAULT`` are injected into the trainer's steps, then the command line runs as is."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from faults import fault_from_environment, inject  # noqa: E402

from mpidl import train  # noqa: E402
from mpidl.app.trainer import Trainer  # noqa: E402

if __name__ == "__main__":
    from mpi4py import MPI

    inject(Trainer, fault_from_environment(MPI.COMM_WORLD.Get_size()))
    sys.exit(train.main())
