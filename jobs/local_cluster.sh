#!/usr/bin/env bash
# bash jobs/local_cluster.sh --epochs 5 --sync-every 20 --metrics runs/cluster.jsonl
#
# Two "nodes" of two ranks each on ONE machine, to try the node-based strategy (and the
# hierarchical one: pass --strategy hierarchical after it, the last value wins) without a
# cluster. Any option of `python -m mpidl.train --help` can follow.
#
# How (jobs/launcher.sh): MPICH's Hydra launcher treats every entry of -hosts as a separate
# node, and `-launcher fork` starts the processes locally instead of over ssh, so
# `-hosts localhost:2,127.0.0.1:2` puts ranks 0-1 and 2-3 on two different "hosts" and
# MPI_Comm_split_type(MPI_COMM_TYPE_SHARED) really returns two node communicators of two
# ranks: the code under test is the code that runs on a cluster. Open MPI's launcher sees one
# node whatever the names, so there the ranks are grouped explicitly by MPIDL_RANKS_PER_NODE=2
# (consecutive ranks form the emulated nodes; `--ranks-per-node 2` does the same).

# Stop at the first failing command and at unset variables.
set -euo pipefail

# The launcher (MPICH's or Open MPI's) and the interpreter; both can be overridden.
MPIEXEC=${MPIEXEC:-mpiexec}
PYTHON=${PYTHON:-python}
# shellcheck source=jobs/launcher.sh
source "$(dirname "${BASH_SOURCE[0]}")/launcher.sh"

# Four ranks share this machine's cores: one thread each keeps them from oversubscribing.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} NUMBA_NUM_THREADS=${NUMBA_NUM_THREADS:-1}

# 4 ranks as 2 nodes x 2 ranks; --strategy node reduces gradients inside each node every step
# and averages parameters between the nodes every K' steps.
mpidl_mpiexec 4 2 "$PYTHON" -m mpidl.train --strategy node "$@"
exec "${MPIDL_CMD[@]}"
