"""The production extras, each an exchange or a channel around the core's, in its own file:

* :mod:`.overlap`       gradient buckets exchanged during the backward pass
* :mod:`.shm`           one copy of the model per node in an MPI-3 shared window
* :mod:`.compress`      16-bit inter-node gradient exchange with error feedback
* :mod:`.sync_overlap`  the node strategy's parameter average in the background

:func:`mpidl.distributed.build.data_parallel` composes them from options; the core
(:class:`~mpidl.distributed.DataParallel`) and the strategies never name them.
"""
