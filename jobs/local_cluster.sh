#!/usr/bin/env bash
# bash jobs/local_cluster.sh --epochs 5 --sync-every 20 --metrics runs/cluster.jsonl
#
# Two "nodes" of two ranks each on ONE machine, to try the node-based strategy (and the
# hierarchical one: pass --strategy hierarchical after it, the last value wins) without a
# cluster. Any option of `python -m mpidl.train --help` can follow.
#
# Why this works: MPICH's Hydra launcher treats every entry of -hosts as a separate node,
# and `-launcher fork` starts the processes locally instead of over ssh. `localhost` and
# `127.0.0.1` are two entries, so with -ppn 2 (processes per node) ranks 0-1 and 2-3 land on
# two different "hosts", and MPI_Comm_split_type(MPI_COMM_TYPE_SHARED) really returns two
# node communicators of two ranks: the code under test is the code that runs on a cluster.
#
# With Open MPI, or any launcher that cannot fake hosts, group the ranks explicitly instead:
#   mpiexec -n 4 python -m mpidl.train --strategy node --ranks-per-node 2 ...
# (or export MPIDL_RANKS_PER_NODE=2): consecutive ranks then form the emulated nodes.

# Stop at the first failing command and at unset variables.
set -euo pipefail

# The launcher must be MPICH's (Hydra) for -ppn/-hosts/-launcher fork; the venv's `mpich`
# wheel provides one. Both can be overridden from the environment.
MPIEXEC=${MPIEXEC:-mpiexec}
PYTHON=${PYTHON:-python}

# Four ranks share this machine's cores: one thread each keeps them from oversubscribing.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} NUMBA_NUM_THREADS=${NUMBA_NUM_THREADS:-1}

# -n 4 -ppn 2 with two host entries = 2 nodes x 2 ranks; --strategy node reduces gradients
# inside each node every step and averages parameters between the nodes every K' steps.
exec "$MPIEXEC" -n 4 -ppn 2 -hosts localhost,127.0.0.1 -launcher fork \
    "$PYTHON" -m mpidl.train --strategy node "$@"
