# MPIDL_RANKS_PER_NODE=2 mpiexec -n 4 python -m mpidl.examples.custom_loop   (2 emulated nodes)
"""Your own training loop on the distributed core: the built-in scene, the node exchange."""
import numpy as np

from mpidl.data import synthetic_splits
from mpidl.distributed import DataParallel, Node, Topology
from mpidl.engine import threads
from mpidl.engine.models import build_model
from mpidl.engine.nn import SoftmaxCrossEntropy
from mpidl.engine.optim import SGD

threads.apply()                                            # threads per rank: cores / ranks here
train, test, _ = synthetic_splits(seed=0)
model = build_model("hsicnn", train.sample_shape, train.num_classes, seed=0)
opt = SGD(model.params, lr=0.02, momentum=0.9)
topology = Topology.from_comm()                            # world, node and leader communicators
dp = DataParallel(model, opt, batch_size=64, exchange=Node(topology, sync_every=10))
loss_fn = SoftmaxCrossEntropy()

for epoch in range(3):
    order = np.random.default_rng([0, epoch]).permutation(train.num_samples)  # same on every rank
    for start in range(0, train.num_samples, 64):
        local = dp.local_indices(order[start:start + 64])  # this rank's slice of the global batch
        x, y = train.read(local)
        loss = loss_fn.forward(model.forward(x), y)        # the local mean loss
        model.backward(loss_fn.backward())                 # fills model.params.grad
        dp.step()                                          # weighted reduce, update, K' sync
        if dp.should_stop:                                 # SIGTERM on any rank, agreed by all
            break
    dp.sync()                                              # every replica identical again
    model.eval()
    x, y = test.read(np.arange(*dp.shard(test.num_samples)))  # each rank scores a shard
    correct = dp.sum(np.array([(model.forward(x).argmax(axis=1) == y).sum()]))[0]
    model.train()
    if dp.rank == 0:
        print(f"epoch {epoch + 1}: loss {loss:.3f}, test accuracy {correct / test.num_samples:.2%}")
    if dp.should_stop:
        break
