#!/bin/bash
# sbatch jobs/slurm_cpu_multi_node.sh --data data/samson.h5 --epochs 50
#
# Several CPU nodes with the node-based strategy of the TNNLS paper: the ranks of a node
# reduce gradients every step through shared memory, and the nodes average their parameters
# only every K' = 50 steps, so inter-node traffic falls by about K' x ranks-per-node.
# Options after the script name go to `python -m mpidl.train`; run from the repository root.
# LAUNCHER=srun|mpiexec sbatch ... chooses what starts the ranks (see the end of the script).
# Stop it with a checkpoint: `scancel --signal=TERM JOBID` (Slurm signals every process of the
# job's steps: the ranks, whether srun or hydra's proxies started them; with LAUNCHER=mpiexec
# under Open MPI use `scancel --batch --signal=USR1 JOBID`).
#
# (Each #SBATCH line is explained on the line above it: comments on the line itself are not
# safe on every Slurm version.)
#
#SBATCH --job-name=mpidl-cpu-nodes
# Four nodes; MPI_COMM_TYPE_SHARED finds them, so no --ranks-per-node is needed.
#SBATCH --nodes=4
# Ranks per node: the node-local reduction averages over these every step.
#SBATCH --ntasks-per-node=8
# Cores for each rank's BLAS / Numba threads.
#SBATCH --cpus-per-task=4
#SBATCH --time=02:00:00
#SBATCH --output=%x-%j.out

# Stop at the first failing command and at unset variables.
set -euo pipefail

PYTHON=${PYTHON:-python}
# Each rank uses exactly the cores of its task.
export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1} NUMBA_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}

# The same options whichever launcher starts the ranks; "$@" last, so it can override any.
train_args=(-m mpidl.train --strategy node --sync-every 50
            --metrics "runs/${SLURM_JOB_ID}.jsonl" "$@")
mkdir -p runs
# The launch line for this MPI (jobs/launcher.sh, read from the submission directory: sbatch
# runs a copy of this script from its spool directory). By default (mpi4py's library
# decides) MPICH's ranks are started by its own mpiexec (hydra) inside the allocation, since
# Slurm's pmi2 plugin cuts MPICH's PMI-1 lines of more than 1024 bytes and MPI_Init then fails
# across nodes (docs/running.md), and Open MPI's by `srun --mpi=pmix`; LAUNCHER=srun or
# LAUNCHER=mpiexec chooses, SRUN_MPI=... gives srun's --mpi type (and means srun).
# shellcheck source=jobs/launcher.sh
source "${SLURM_SUBMIT_DIR:-.}/jobs/launcher.sh"

# srun: no hostfile, and Slurm's own process binding (--cpu-bind, srun only). mpiexec (MPICH's
# default, or LAUNCHER=mpiexec): MPICH's Hydra and Open MPI's mpirun both read the Slurm
# allocation themselves; the tasks per node are spelled out (MPICH -ppn N, Open MPI --map-by
# ppr:N:node) to make the placement explicit.
mpidl_slurm_launch --cpu-bind=cores -- "$PYTHON" "${train_args[@]}"
# exec: no shell between Slurm and the launcher, so SIGTERM at the time limit reaches the
# ranks, which checkpoint and exit 0 (see README, "Resuming, failures, signals").
exec "${MPIDL_CMD[@]}"
