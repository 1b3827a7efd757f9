#!/bin/bash
# sbatch jobs/slurm_cpu_single_node.sh --data data/samson.h5 --epochs 50
#
# One CPU node, one MPI rank per Slurm task. Options after the script name go to
# `python -m mpidl.train` (sbatch passes them on); run from the repository root.
# LAUNCHER=srun|mpiexec sbatch ... chooses what starts the ranks (see below).
# Stop it with a checkpoint: `scancel --signal=TERM JOBID` (Slurm signals every process of the
# job's steps: the ranks, whether srun or hydra's proxies started them; with LAUNCHER=mpiexec
# under Open MPI use `scancel --batch --signal=USR1 JOBID`, since Open MPI's mpiexec aborts the
# job on SIGTERM); tests/slurm_stage.sh does this on a real Slurm.
#
# (A comment on an #SBATCH line itself is not safe on every Slurm version, so each one is
# explained on the line above it.)
#
# A name to find the job by in squeue / sacct.
#SBATCH --job-name=mpidl-cpu
# Everything on one node: every strategy then reduces through shared memory only.
#SBATCH --nodes=1
# One MPI rank per task.
#SBATCH --ntasks=8
# Cores for each rank's BLAS / Numba threads (OMP_NUM_THREADS below follows it).
#SBATCH --cpus-per-task=4
#SBATCH --time=01:00:00
# %x = job name, %j = job id: one log per job, next to where it was submitted.
#SBATCH --output=%x-%j.out

# Stop at the first failing command and at unset variables.
set -euo pipefail

# sbatch exports the submitting shell's environment, so `python` is the one of the venv that
# was active at submission; PYTHON overrides it.
PYTHON=${PYTHON:-python}

# Let each rank use exactly the cores Slurm gave its task, no more (oversubscription) and
# no fewer (idle cores).
export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1} NUMBA_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}

mkdir -p runs
# The launch line for this MPI (jobs/launcher.sh, read from the submission directory: sbatch
# runs a copy of this script from its spool directory). By default (mpi4py's library
# decides) MPICH's ranks are started by its own mpiexec (hydra) inside the allocation, since
# Slurm's pmi2 plugin cuts MPICH's PMI-1 lines of more than 1024 bytes and MPI_Init then fails
# across nodes (docs/running.md), and Open MPI's by `srun --mpi=pmix`; LAUNCHER=srun or
# LAUNCHER=mpiexec chooses, SRUN_MPI=... gives srun's --mpi type (and means srun).
# shellcheck source=jobs/launcher.sh
source "${SLURM_SUBMIT_DIR:-.}/jobs/launcher.sh"

# srun starts the ranks itself and hands them their MPI wiring (PMI-2 or PMIx: `srun
# --mpi=list` shows what the site supports); hydra reads the allocation and starts a proxy
# per node with srun. --cpu-bind=cores (srun only) pins each rank to its own cores so the
# speeds it measures stay stable. The metrics file is named after the job; a --metrics in
# "$@" comes later and wins.
mpidl_slurm_launch --cpu-bind=cores -- \
    "$PYTHON" -m mpidl.train --metrics "runs/${SLURM_JOB_ID}.jsonl" "$@"
# exec: no shell between Slurm and the launcher, so SIGTERM at the time limit reaches the
# ranks, which checkpoint and exit 0 (see README, "Resuming, failures, signals").
exec "${MPIDL_CMD[@]}"
