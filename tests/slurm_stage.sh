#!/usr/bin/env bash
# bash tests/slurm_stage.sh      -- jobs/slurm_cpu_single_node.sh under a real Slurm
#
# Starts (or finds) a one-machine Slurm (jobs/local_slurm.sh: Debian's munge, slurmctld,
# slurmd), then, on a tiny data file:
#   1. a short job to its end: exit code 0, the "done: completed" summary with its test OA
#      in the job's output, and an `end` record `stopped: completed` in its metrics;
#   2. a longer job, stopped by `scancel --signal=TERM` as soon as it trains: it must end
#      with exit code 0 (scontrol's ExitCode=0:0), `stopped: signal` and a checkpoint;
#   3. a third job with --resume: it continues from that checkpoint and completes.
# The ranks start as the script starts them (LAUNCHER, SRUN_MPI: see jobs/launcher.sh); the
# job gets 2 tasks of 1 CPU (the sbatch options on the command line override the script's).
# Exit code 0 when every check passes, 1 when one fails, 77 when Slurm cannot run here
# (neither a slurmctld that answers nor root with apt-get).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
PY=${PYTHON:-python}
export PYTHON=$PY OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 NUMBA_NUM_THREADS=1

say() { echo "slurm_stage: $*"; }
fail() { say "FAILED: $*" >&2; exit 1; }

if ! (command -v scontrol >/dev/null && scontrol ping 2>/dev/null | grep -q "is UP"); then
    if (( EUID != 0 )) || ! command -v apt-get >/dev/null; then
        say "skipped: no slurmctld answers, and no root + apt-get to start one"
        exit 77
    fi
    bash jobs/local_slurm.sh start
    # A Slurm this stage started goes when it ends, also when a check fails.
    trap 'bash jobs/local_slurm.sh stop' EXIT
fi

WORK=$(mktemp -d /tmp/mpidl-slurm-stage.XXXXXX)
say "work folder $WORK"
# 480 training patches of 4 bands x 5 x 5 pixels, 3 classes: seconds per epoch.
"$PY" - "$WORK/tiny.h5" <<'EOF'
import sys
import numpy as np
from mpidl.data.layout import write_layout
rng = np.random.default_rng(0)
def split(n):
    y = rng.integers(0, 3, n)
    return rng.standard_normal((n, 4, 5, 5)).astype(np.float32) + 0.7 * y[:, None, None, None], y
write_layout(sys.argv[1], {"train": split(480), "test": split(120)}, ["a", "b", "c"], source="slurm_stage")
EOF

SCRIPT=$REPO/jobs/slurm_cpu_single_node.sh
# Submitted from the repository root (the scripts read jobs/launcher.sh from there); each job
# runs in $WORK, so its runs/ and output land there. 2 tasks x 1 CPU fit any machine.
submit() { sbatch --parsable --chdir="$WORK" --ntasks=2 --cpus-per-task=1 --time=00:15:00 "$@"; }
common=(--data "$WORK/tiny.h5" --batch-size 32 --speeds 1,1 --seed 0)

record() {  # the last record of a metrics file whose "event" is $2, as JSON
    "$PY" -c 'import json, sys
recs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
ends = [r for r in recs if r.get("event") == sys.argv[2]]
print(json.dumps(ends[-1]) if ends else "{}")' "$1" "$2"
}
field() { "$PY" -c 'import json, sys; print(json.loads(sys.argv[1]).get(sys.argv[2]))' "$1" "$2"; }
exit_code() { scontrol show job "$1" | grep -o 'ExitCode=[0-9:]*' | head -n 1 | cut -d= -f2; }
wait_gone() {  # until the job has left the queue (completed, failed or cancelled)
    local i reason
    for ((i = 0; i < 600; i++)); do
        if [[ -z "$(squeue -h -j "$1" -o %i 2>/dev/null)" ]]; then return 0; fi
        # A job this Slurm can never start (more CPUs or nodes than the partition has) would
        # wait for ever: fail at once, with the reason.
        reason=$(squeue -h -j "$1" -o %r 2>/dev/null || true)
        case "$reason" in
            PartitionConfig|PartitionNodeLimit|BadConstraints|ReqNodeNotAvail*)
                scancel "$1" || true
                fail "job $1 cannot start here (reason $reason): $(scontrol show node | grep -E 'NodeName|CPUTot')" ;;
        esac
        sleep 1
    done
    scancel "$1" || true
    fail "job $1 still in the queue after 10 minutes"
}
run_to_end() {  # submit, wait until the job leaves the queue, fail unless ExitCode=0:0; prints the job id
    local job code
    job=$(submit "$@")
    wait_gone "$job" >&2
    code=$(exit_code "$job")
    [[ "$code" == 0:0 ]] || { cat "$WORK"/*-"$job".out >&2 || true; fail "job $job ended with ExitCode=$code"; }
    echo "$job"
}

# ---- 1. one job to its end
say "1. sbatch jobs/slurm_cpu_single_node.sh (2 tasks, 2 epochs) to its end"
job=$(run_to_end --job-name=mpidl-stage-run "$SCRIPT" "${common[@]}" --epochs 2 --metrics "$WORK/run.jsonl")
out="$WORK/mpidl-stage-run-$job.out"
cat "$out"
grep -q "mpidl: 2 rank(s)" "$out" || fail "job $job did not run 2 ranks"
oa=$(grep -o 'done: completed.*test OA [0-9.]*%' "$out" | grep -o '[0-9.]*%$' || true)
[[ -n "$oa" ]] || fail "job $job printed no 'done: completed ... test OA'"
end=$(record "$WORK/run.jsonl" end)
[[ $(field "$end" stopped) == completed ]] || fail "job $job metrics: $end"
say "job $job: exit code 0, test OA $oa"

# ---- 2. a job stopped by scancel --signal=TERM
say "2. scancel --signal=TERM a running job: checkpoint and exit code 0"
job=$(submit --job-name=mpidl-stage-term "$SCRIPT" "${common[@]}" --epochs 12 \
      --checkpoint "$WORK/ck" --metrics "$WORK/term.jsonl")
for ((i = 0; i < 600; i++)); do  # until it trains (the start record follows the handler)
    if grep -qs '"event": "start"' "$WORK/term.jsonl"; then break; fi
    [[ -n "$(squeue -h -j "$job" -o %i)" ]] || fail "job $job ended before training: $(cat "$WORK"/mpidl-stage-term-*.out)"
    sleep 0.5
done
scancel --signal=TERM "$job"
wait_gone "$job"
out="$WORK/mpidl-stage-term-$job.out"
cat "$out"
code=$(exit_code "$job")
[[ "$code" == 0:0 ]] || fail "job $job ended with ExitCode=$code"
end=$(record "$WORK/term.jsonl" end)
[[ $(field "$end" stopped) == signal ]] || fail "job $job metrics: $end"
stopped_at=$(field "$end" step)
[[ -f "$WORK/ck/checkpoint.h5" ]] || fail "job $job wrote no checkpoint"
grep -q "checkpoint:" "$out" || fail "job $job did not report its checkpoint"
say "job $job: stopped by SIGTERM after step $stopped_at, checkpoint written, exit code 0"

# ---- 3. a job that resumes it
say "3. sbatch ... --resume: continues from the checkpoint and completes"
job=$(run_to_end --job-name=mpidl-stage-resume "$SCRIPT" "${common[@]}" --epochs 12 \
      --checkpoint "$WORK/ck" --resume --metrics "$WORK/term.jsonl")
out="$WORK/mpidl-stage-resume-$job.out"
tail -n 3 "$out"
grep -q "resumed from" "$out" || fail "job $job did not resume"
end=$(record "$WORK/term.jsonl" end)
[[ $(field "$end" stopped) == completed ]] || fail "job $job metrics: $end"
steps=$(field "$end" step)
(( steps > stopped_at )) || fail "job $job ended at step $steps, not after $stopped_at"
say "job $job: resumed after step $stopped_at, completed at step $steps"

rm -rf "$WORK"
say "all Slurm checks passed"
