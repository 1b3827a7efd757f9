#!/bin/bash
# sbatch jobs/slurm_gpu.sh --data data/samson.h5 --epochs 50
#
# GPU training, one MPI rank per GPU (CuPy backend, --device gpu). Options after the script
# name go to `python -m mpidl.train`; run from the repository root. Needs the `gpu` extra
# (pip install -e '.[gpu]'; cupy-cuda13x on a CUDA 13 machine).
#
# (Each #SBATCH line is explained on the line above it.)
#
#SBATCH --job-name=mpidl-gpu
#SBATCH --nodes=1
# One rank per GPU: a rank drives exactly one device.
#SBATCH --ntasks-per-node=4
# Slurm gives each task its own GPU and sets CUDA_VISIBLE_DEVICES for it, so every rank
# sees its GPU as device 0, which is the one the backend uses.
#SBATCH --gpus-per-task=1
# CPU cores per rank for data loading and the host side of the step.
#SBATCH --cpus-per-task=8
#SBATCH --time=01:00:00
#SBATCH --output=%x-%j.out

# Stop at the first failing command and at unset variables.
set -euo pipefail

PYTHON=${PYTHON:-python}
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

# Sites whose Slurm does not bind GPUs per task (all ranks see every GPU, and would all use
# device 0) set GPU_BIND=localid: a tiny wrapper then gives rank k of the node GPU k by
# exporting CUDA_VISIBLE_DEVICES=$SLURM_LOCALID before Python starts (single quotes: the
# variable is expanded by each task, where Slurm has set it, not here). Otherwise the wrapper
# is a plain `env`, which just runs the command (and avoids an empty array, which `set -u`
# rejects in bash before 4.4).
wrapper=(env)
if [[ "${GPU_BIND:-slurm}" == localid ]]; then
    wrapper=(bash -c 'export CUDA_VISIBLE_DEVICES=$SLURM_LOCALID; exec "$@"' bind-gpu)
fi

# --device gpu puts arrays on the GPU (CuPy); the reducers synchronize the device stream
# before a GPU buffer is handed to MPI. The metrics file is named after the job id.
# exec: no shell between Slurm and the launcher, so SIGTERM at the time limit reaches the
# ranks, which checkpoint and exit 0 (see README, "Resuming, failures, signals").
mpidl_slurm_launch -- "${wrapper[@]}" \
    "$PYTHON" -m mpidl.train --device gpu --metrics "runs/${SLURM_JOB_ID}.jsonl" "$@"
exec "${MPIDL_CMD[@]}"
