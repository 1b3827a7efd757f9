#!/usr/bin/env bash
# bash tests/run_all.sh      -- the whole test suite, as the README and CI run it
#
# 1. serial tests (pytest, no launcher);
# 2. the Numba CUDA kernels under the CUDA simulator (its own process: the simulator is
#    chosen when numba is first imported);
# 3. the MPI tests under mpiexec with 1, 2 and 4 ranks, with 2 emulated nodes of 2 ranks
#    (MPICH treats each -hosts entry as a node, so MPI_COMM_TYPE_SHARED really splits), with
#    unequal nodes (2 + 1 ranks), and with the MPIDL_RANKS_PER_NODE override.
# Stops at the first failing stage and exits non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
MPIEXEC=${MPIEXEC:-$(dirname "$(command -v "$PY")")/mpiexec}
[ -x "$MPIEXEC" ] || MPIEXEC=mpiexec
# MPI jobs on an oversubscribed machine: cap each rank's threads (they would fight otherwise).
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 NUMBA_NUM_THREADS=1
PYTEST=("$PY" -m pytest -q -p no:cacheprovider)
FORK=(-launcher fork)

stage() { echo; echo "=== $*"; }

stage "serial tests"
"${PYTEST[@]}" tests -m "not mpi" --ignore=tests/mpi --ignore=tests/cudasim

stage "CUDA kernels under the Numba CUDA simulator"
NUMBA_ENABLE_CUDASIM=1 "${PYTEST[@]}" tests/cudasim

for np in 1 2 4; do
  stage "MPI tests, $np rank(s)"
  "$MPIEXEC" -n "$np" "${FORK[@]}" "${PYTEST[@]}" --with-mpi tests/mpi
done

stage "MPI tests, 2 nodes x 2 ranks (MPICH -hosts emulation)"
"$MPIEXEC" -n 4 -ppn 2 -hosts localhost,127.0.0.1 "${FORK[@]}" "${PYTEST[@]}" --with-mpi tests/mpi

stage "MPI tests, unequal nodes 2 + 1"
"$MPIEXEC" -n 3 -hosts localhost:2,127.0.0.1:1 "${FORK[@]}" "${PYTEST[@]}" --with-mpi tests/mpi

stage "MPI tests, 4 ranks with MPIDL_RANKS_PER_NODE=2"
MPIDL_RANKS_PER_NODE=2 "$MPIEXEC" -n 4 "${FORK[@]}" "${PYTEST[@]}" --with-mpi tests/mpi

echo; echo "=== all test stages passed"
