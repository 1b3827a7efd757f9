"""A rank that fails while the others wait in a node-shared barrier or a pending
non-blocking collective (run by tests/test_faults_hiding.py under mpiexec).

    python tests/fault_hiding.py MODE STAMP     MODE: shm-raise | shm-kill | overlap-raise | overlap-kill

Rank 1 fails at step 2: in the ``shm`` modes before its step (rank 0 is then certainly
waiting in the window's first barrier: it cannot pass it without rank 1), in the
``overlap`` modes after its backward has started the buckets (rank 0 waits in the final wait
for buckets rank 1 never sends). Rank 1 first writes ``TIME PID`` into STAMP: the time of its
failure, and its PID (a killed process says nothing and the launcher names it by its PID only;
a file, unlike a printed line, is certainly complete before the kill).
"""

import os
import signal
import sys
import time

import numpy as np

from mpidl.distributed import data_parallel
from mpidl.distributed.launch import abort_on_uncaught_exception
from mpidl.engine.models import build_model
from mpidl.engine.nn import SoftmaxCrossEntropy
from mpidl.engine.optim import SGD


def main(mode: str, stamp: str) -> None:
    sys.excepthook = abort_on_uncaught_exception
    model = build_model("hsicnn", (4, 5, 5), 3, seed=0, channels=(4, 4), hidden=8)
    kwargs = {"intra": "shm"} if mode.startswith("shm") else {"overlap": True, "bucket_mb": 1e-4}
    dp = data_parallel(model, SGD(model.params, lr=0.1), batch_size=4, **kwargs)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 4, 5, 5)).astype(np.float32)
    y = rng.integers(0, 3, 4)
    loss = SoftmaxCrossEntropy()
    for step in range(5):
        local = dp.local_indices(np.arange(4))
        loss.forward(model.forward(x[local]), y[local])
        failing = step == 2 and dp.rank == 1
        if failing and mode.startswith("shm"):
            fail(mode, stamp)
        model.backward(loss.backward())
        if failing:
            fail(mode, stamp)
        dp.step()
    dp.close()


def fail(mode: str, stamp: str) -> None:
    with open(stamp, "w") as f:
        f.write(f"{time.time()!r} {os.getpid()}")
    if mode.endswith("kill"):
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError(f"injected failure ({mode})")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
