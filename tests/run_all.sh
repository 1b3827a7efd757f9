#!/usr/bin/env bash
# bash tests/run_all.sh [all|mpi]   -- the whole test suite, as the README and CI run it
#
# 1. serial tests (pytest, no launcher);
# 2. the Numba CUDA kernels under the CUDA simulator (its own process: the simulator is
#    chosen when numba is first imported);
# 3. the MPI tests under mpiexec with 1, 2 and 4 ranks, with 2 emulated nodes of 2 ranks,
#    with unequal nodes (2 + 1 ranks), and with the MPIDL_RANKS_PER_NODE override;
# 4. the cluster stage (tests/cluster_stage.sh): a 2-host cluster of network namespaces
#    (jobs/cluster.sh) where the machine allows it (root, namespaces, tbf; else skipped with
#    the reason; CLUSTER_STAGE=0 skips it, CLUSTER_STAGE=1 requires it), torn down at its end;
# 5. the Slurm stage (tests/slurm_stage.sh) when Slurm can run here: a slurmctld answers, or
#    root with apt-get can install one (SLURM_STAGE=0 skips it, SLURM_STAGE=1 requires it).
# `mpi` runs only what depends on the MPI: the serial tests that start mpiexec themselves
# (marker `launcher`, except the slow benchmark runs), stage 3 and stage 4 (CI runs them
# again under Open MPI).
#
# The MPI is the one mpi4py of $PYTHON loads (MPI.Get_library_version()): MPICH or Open MPI.
# The launcher is $MPIEXEC, else the mpiexec beside $PYTHON, else the one on PATH; it must be
# of the same MPI (checked). jobs/launcher.sh knows each one's flags: MPICH fakes nodes with
# -hosts localhost:2,127.0.0.1:2 (real MPI_COMM_TYPE_SHARED nodes), Open MPI cannot and gets
# MPIDL_RANKS_PER_NODE instead, so there the "2 nodes" and "override" stages are one.
# Stops at the first failing stage and exits non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."
WHAT=${1:-all}
case "$WHAT" in all|mpi) ;; *) echo "usage: bash tests/run_all.sh [all|mpi]" >&2; exit 2 ;; esac
PY=${PYTHON:-python}
export PYTHON=$PY
MPIEXEC=${MPIEXEC:-$(dirname "$(command -v "$PY")")/mpiexec}
[ -x "$MPIEXEC" ] || MPIEXEC=$(command -v mpiexec || echo mpiexec)
export MPIEXEC
# shellcheck source=jobs/launcher.sh
source jobs/launcher.sh
library=$(mpidl_library_flavor "$PY")
launcher=$(MPIDL_MPI_FLAVOR="" mpidl_mpi_flavor "$MPIEXEC")
if [[ "$library" != "$launcher" ]]; then
    echo "run_all: mpi4py of $PY loads $library, but $MPIEXEC is $launcher's launcher;" \
         "set MPIEXEC to the mpiexec of $library" >&2
    exit 2
fi
# The tests' launcher helper (tests/launcher.py) reads the flavour from here.
export MPIDL_MPI_FLAVOR=$library
# MPI jobs on an oversubscribed machine: cap each rank's threads (they would fight otherwise).
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 NUMBA_NUM_THREADS=1
if [[ "$library" == openmpi && $EUID -eq 0 ]]; then
    # Open MPI refuses root without these (the tests' own launches add --allow-run-as-root).
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
PYTEST=("$PY" -m pytest -q -p no:cacheprovider)

stage() { echo; echo "=== $* [$library, $(date -u +%H:%M:%S)]"; }
# Runs "${MPIDL_CMD[@]}" set by mpidl_mpiexec RANKS NODES PROGRAM... (jobs/launcher.sh).
mpi_stage() { mpidl_mpiexec "$@"; echo "\$ ${MPIDL_CMD[*]}"; "${MPIDL_CMD[@]}"; }
# optional_stage SCRIPT MODE WHY: runs SCRIPT; its exit code 77 (cannot run here) is a skip when
# MODE is auto, a failure when it is 1 (the stage required); any other non-zero code stops.
optional_stage() {
    local code=0
    bash "$1" || code=$?
    if (( code == 77 )) && [[ "$2" == auto ]]; then
        echo "run_all: $1 skipped ($3)"
    elif (( code != 0 )); then
        exit "$code"
    fi
}

if [[ "$WHAT" == all ]]; then
    stage "serial tests"
    "${PYTEST[@]}" tests -m "not mpi" --ignore=tests/mpi --ignore=tests/cudasim

    stage "CUDA kernels under the Numba CUDA simulator"
    NUMBA_ENABLE_CUDASIM=1 "${PYTEST[@]}" tests/cudasim
else
    # Not the benchmarks' quick runs (marked slow too): minutes of 4-rank jobs that test the
    # benchmark scripts, not the MPI; they run in the full pass.
    stage "serial tests that start mpiexec (marker launcher, not slow)"
    "${PYTEST[@]}" tests -m "launcher and not slow and not mpi" --ignore=tests/mpi --ignore=tests/cudasim
fi

for np in 1 2 4; do
    stage "MPI tests, $np rank(s)"
    mpi_stage "$np" 1 "${PYTEST[@]}" --with-mpi tests/mpi
done

stage "MPI tests, 2 nodes x 2 ranks"
mpi_stage 4 2 "${PYTEST[@]}" --with-mpi tests/mpi

stage "MPI tests, unequal nodes 2 + 1"
mpi_stage 3 2,1 "${PYTEST[@]}" --with-mpi tests/mpi

if [[ "$library" == mpich ]]; then
    # Under Open MPI the 2 x 2 stage above already is this override.
    stage "MPI tests, 4 ranks with MPIDL_RANKS_PER_NODE=2"
    MPIDL_RANKS_PER_NODE=2 mpi_stage 4 1 "${PYTEST[@]}" --with-mpi tests/mpi
fi

if [[ "${CLUSTER_STAGE:-auto}" != 0 ]]; then
    # Under both MPIs (CI's Open MPI pass runs `mpi`): the hosts are real network stacks, which
    # nothing above has.
    stage "a real 2-host cluster: equivalence, kernel bytes, two-node Slurm, faults (tests/cluster_stage.sh)"
    optional_stage tests/cluster_stage.sh "${CLUSTER_STAGE:-auto}" "see the reason above"
fi

if [[ "$WHAT" == all && "${SLURM_STAGE:-auto}" != 0 ]]; then
    stage "Slurm: jobs/slurm_cpu_single_node.sh under a one-machine Slurm (tests/slurm_stage.sh)"
    optional_stage tests/slurm_stage.sh "${SLURM_STAGE:-auto}" "no Slurm here and none can be installed"
fi

echo; echo "=== all test stages passed ($library)"
