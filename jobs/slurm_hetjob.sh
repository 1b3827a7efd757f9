#!/bin/bash
# sbatch jobs/slurm_hetjob.sh --data data/samson.h5 --epochs 50
#
# A heterogeneous job: a CPU node and a GPU node in ONE MPI_COMM_WORLD, the setting of
# heterogeneous data parallelism. With --speeds auto every rank measures its own speed, and
# its local batch (and its share of each epoch) follows that speed, so the slow CPU ranks and
# the fast GPU ranks finish every step together.
# Options after the script name go to BOTH components; run from the repository root.
#
# (Each #SBATCH line is explained on the line above it.)
#
# Component 0: CPU ranks. Options before `#SBATCH hetjob` describe this component.
#SBATCH --job-name=mpidl-het
#SBATCH --time=01:00:00
#SBATCH --output=%x-%j.out
#SBATCH --partition=cpu
#SBATCH --nodes=1
#SBATCH --ntasks=4
#SBATCH --cpus-per-task=8
# The separator: every option after it describes the next component.
#SBATCH hetjob
# Component 1: GPU ranks, one per GPU.
#SBATCH --partition=gpu
#SBATCH --nodes=1
#SBATCH --ntasks=2
#SBATCH --gpus-per-task=1
#SBATCH --cpus-per-task=8

# Stop at the first failing command and at unset variables.
set -euo pipefail

PYTHON=${PYTHON:-python}
mkdir -p runs
# The srun --mpi type for this MPI (jobs/launcher.sh, from the submission directory): pmi2
# for MPICH, pmix for Open MPI; SRUN_MPI=... overrides. A heterogeneous step needs srun (no
# hydra), and its components sit on different nodes: with the `mpich` wheel, whose PMI-1
# lines Slurm's pmi2 plugin cuts at 1024 bytes, MPI_Init can fail there (docs/running.md);
# use Open MPI, or an MPICH built with Slurm's PMI-2 library.
# shellcheck source=jobs/launcher.sh
source "${SLURM_SUBMIT_DIR:-.}/jobs/launcher.sh"
mpi=$(mpidl_srun_mpi)

# Options every rank must get alike. Each rank parses its own command line, so the two
# components may differ in --device, but --dtype, --batch-size, --strategy, --seed, --model
# and every other option must be the same on all ranks, or the ranks disagree about the
# buffers they exchange. The components sit on different nodes, so hierarchical (exact)
# sends one inter-node message per step; --strategy node --sync-every 50 sends far fewer.
# The metrics are written by rank 0, a CPU rank, whose config records --device cpu.
common=(-m mpidl.train --speeds auto --strategy hierarchical --dtype float32
        --metrics "runs/${SLURM_JOB_ID}.jsonl" "$@")

# One MPMD step across both components: the part before ` : ` runs in component 0 (CPU
# ranks 0-3 of MPI_COMM_WORLD), the part after it in component 1 (GPU ranks 4-5).
# Each part sets its own threads: CPU ranks use their cores for BLAS, GPU ranks need few.
# --mpi is repeated after the colon: harmless where the first block's value propagates.
# exec: no shell between Slurm and the launcher, so SIGTERM at the time limit reaches the
# ranks, which checkpoint and exit 0 (see README, "Resuming, failures, signals").
exec srun --mpi="$mpi" --cpu-bind=cores \
        env OMP_NUM_THREADS="${SLURM_CPUS_PER_TASK_HET_GROUP_0:-8}" \
        "$PYTHON" "${common[@]}" --device cpu \
    : --mpi="$mpi" \
        env OMP_NUM_THREADS=1 \
        "$PYTHON" "${common[@]}" --device gpu
