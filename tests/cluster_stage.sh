#!/usr/bin/env bash
# bash tests/cluster_stage.sh   -- mpidl on a real 2-host cluster (jobs/cluster.sh), under the
#                                 MPI that mpi4py of $PYTHON loads (MPICH or Open MPI)
#
# Brings up cluster `mpidlci` (2 hosts x 2 CPUs, 1 Gbit/s links, a Slurm when it can be run)
# and removes it at the end, also when a check fails (trap). Then, each launched as the job
# scripts launch (jobs/launcher.sh with MPIDL_CLUSTER, or sbatch):
#   0. `cluster.sh cpu`: half a core sets a quota, the host's whole cpuset none;
#   1. flat and hierarchical across the 2 hosts equal one process (float64, <= 1e-10:
#      tests/mpi/test_training_equivalence.py, 1 rank per host);
#   2. the node strategy (2 hosts x 2 ranks, K'=1): the bytes the kernel saw leave host 1 in
#      each epoch are within 15 % of mpidl's own inter-node counters (the metrics' `wire` and
#      `comm` records);
#   3. Slurm: under MPICH, a PMI-1 request of more than 1024 bytes crosses the job scripts'
#      launch line whole between 2 hosts (tests/pmi1_probe.py); sbatch --nodes=2
#      jobs/slurm_cpu_multi_node.sh runs on both hosts; a job stopped by scancel
#      --signal=TERM checkpoints, a new job resumes from it, and its final model equals
#      bitwise the one of a job that ran straight through. Every job must end with exit code
#      0 as checked, in every run: no retry, no warning instead of a failure;
#   4. fault (a): host 2's link cut for good in training: the job ends within
#      MPIDL_FAULT_TIMEOUT + 30 s (MPIDL_FAULT_TIMEOUT=10 here) with no `end` record, and a
#      new job resumes from the last checkpoint and completes;
#   5. fault (d): every rank of host 2 SIGKILLed: the job ends within 10 s;
#   6. the failure bound, with the MPI's time-out off, under python -m mpidl.guard: (MPICH)
#      host 2's ranks SIGKILLed under mpiexec -disable-auto-cleanup, and (both) host 2 frozen
#      for good: exit code 3 within 30 s / 45 s, and the message names host 2.
#   7. (CLUSTER_FAULTS=all, Open MPI) grow back on real hosts (tests/test_grow.py -k spare_host)
#      on a second cluster `${NAME:0:7}g` of 3 hosts: a rank on each of hosts 1 and 2, host 2's
#      rank killed, a rank joining on host 3 (--replace-with, a spare of the allocation); flat
#      and hierarchical, the final parameters those of a fault-free run (float64, <= 1e-12).
#      Not in CI's run: Open MPI 5.0.11's daemon of the survivors' host aborts in its PMIx
#      server in the spawn's connect in some runs (the test failed in 2 of 76 runs here, one with
#      prterun's lost-daemon message; far more often when that daemon also
#      holds a dead rank), and prterun ends the job (docs/failures.md, Grow back, limits;
#      benchmarks/ulfm_spawn_probe.py shows it without mpidl).
# CLUSTER_FAULTS=all adds (b) link cut for 3 s and restored, (c) host 2 frozen for good,
# (e) host 2's link lowered to 50 Mbit/s in training; each prints its time to end.
# Exit code 0 when every check passes, 1 when one fails, 77 when no cluster can run here
# (not root, no namespaces, no tbf: the reason is printed; tests/run_all.sh turns 77 into a
# failure under CLUSTER_STAGE=1, which CI sets). Slurm's part is skipped, with the reason,
# only where Slurm is neither installed nor installable (no apt-get), and never under
# CLUSTER_STAGE=1: there a missing Slurm fails the stage.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
PY=${PYTHON:-python}
# The Slurm jobs run in another folder: the interpreter by an absolute path (not resolved
# through its links, which would leave the venv).
PY=$(command -v "$PY") || { echo "cluster_stage: no interpreter '${PYTHON:-python}'" >&2; exit 1; }
[[ "$PY" == /* ]] || PY=$REPO/$PY
# mpiexec: $MPIEXEC (tests/run_all.sh sets it), else the one beside the interpreter.
if [[ -z "${MPIEXEC:-}" && -x "$(dirname "$PY")/mpiexec" ]]; then export MPIEXEC=$(dirname "$PY")/mpiexec; fi
NAME=${CLUSTER_STAGE_NAME:-mpidlci}
export PYTHON=$PY OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 NUMBA_NUM_THREADS=1
say() { echo "cluster_stage: $*"; }
fail() { say "FAILED: $*" >&2; exit 1; }

if (( EUID != 0 )); then say "skipped: needs root (network namespaces, tc, cgroups)"; exit 77; fi
if ! reason=$(bash jobs/cluster.sh --name "$NAME" check 2>&1); then say "skipped: $reason"; exit 77; fi

# shellcheck source=jobs/launcher.sh
source jobs/launcher.sh
kind=$(mpidl_library_flavor "$PY")
export MPIDL_MPI_FLAVOR=$kind
if [[ "$kind" == openmpi ]]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
slurm=(--slurm)
if ! command -v slurmctld >/dev/null && ! command -v apt-get >/dev/null; then
    [[ "${CLUSTER_STAGE:-auto}" == 1 ]] && fail "CLUSTER_STAGE=1, but Slurm is not installed and cannot be (no apt-get)"
    slurm=()
    say "Slurm part skipped: Slurm is not installed and cannot be (no apt-get)"
fi

WORK=$(mktemp -d /tmp/mpidl-cluster-stage.XXXXXX)
cleanup() {
    local code=$?
    bash jobs/cluster.sh --name "$NAME" stop || code=1
    bash jobs/cluster.sh --name "${NAME:0:7}g" stop >/dev/null 2>&1 || true
    rm -rf "$WORK"
    exit "$code"
}
trap cleanup EXIT
bash jobs/cluster.sh --name "$NAME" start --hosts 2 --ranks 2 --rate 1gbit "${slurm[@]}"
eval "$(bash jobs/cluster.sh --name "$NAME" env)"
export MPIDL_CLUSTER=$NAME

# 0. CPU shares: half a core is a quota; a share of the host's whole cpuset is none (a quota of
#    exactly its cores only throttles).
share_shown() { bash jobs/cluster.sh --name "$NAME" status | awk -v h="$NAME-node1" '$1 == h { for (i = 1; i < NF; i++) if ($i == "cpu") print $(i + 1) }'; }
cores_of_host1=$(bash jobs/cluster.sh --name "$NAME" status | awk -v h="$NAME-node1" '$1 == h { for (i = 1; i < NF; i++) if ($i == "cores") print $(i + 1) }' \
    | awk -F, '{ n = 0; for (i = 1; i <= NF; i++) { split($i, r, "-"); n += (r[2] == "" ? 1 : r[2] - r[1] + 1) } print n }')
bash jobs/cluster.sh --name "$NAME" cpu 1 0.5 > /dev/null
[[ "$(share_shown)" == 0.50 ]] || fail "cpu 1 0.5: host 1's share shows '$(share_shown)', not 0.50"
bash jobs/cluster.sh --name "$NAME" cpu 1 "$cores_of_host1" > /dev/null
[[ "$(share_shown)" == none ]] || fail "cpu 1 $cores_of_host1 (its whole cpuset): a quota of $(share_shown) is set"
bash jobs/cluster.sh --name "$NAME" cpu 1 none > /dev/null

"$PY" - "$WORK/tiny.h5" <<'EOF'
import sys
import numpy as np
from mpidl.data.layout import write_layout
rng = np.random.default_rng(0)
def split(n):
    y = rng.integers(0, 3, n)
    return rng.standard_normal((n, 4, 5, 5)).astype(np.float32) + 0.7 * y[:, None, None, None], y
write_layout(sys.argv[1], {"train": split(480), "test": split(120)}, ["a", "b", "c"], source="cluster_stage")
EOF
common=(--data "$WORK/tiny.h5" --batch-size 32 --speeds 1,1 --seed 0)

record() {  # the last record of a metrics file whose "event" is $2, as JSON ({} if none)
    "$PY" -c 'import json, sys
recs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()] if __import__("os").path.exists(sys.argv[1]) else []
ends = [r for r in recs if r.get("event") == sys.argv[2]]
print(json.dumps(ends[-1]) if ends else "{}")' "$1" "$2"
}
now() { date +%s.%N; }
seconds() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }

# ---- 1. equivalence across real hosts
say "1. flat and hierarchical on 2 hosts x 1 rank equal one process (float64, <= 1e-10)"
mpidl_mpiexec 2 2 "$PY" -m pytest -q -p no:cacheprovider --with-mpi tests/mpi/test_training_equivalence.py -k exact_strategies
echo "\$ ${MPIDL_CMD[*]}"
"${MPIDL_CMD[@]}" || fail "the equivalence tests failed on the cluster"

# ---- 2. the kernel's bytes against mpidl's counters
say "2. node strategy, 2 hosts x 2 ranks, K'=1: bytes on host 1's wire vs mpidl's inter-node counters"
mpidl_mpiexec 4 2 "$PY" -m mpidl.train "${common[@]}" --speeds 1,1,1,1 --strategy node --sync-every 1 \
    --epochs 2 --metrics "$WORK/bytes.jsonl"
"${MPIDL_CMD[@]}" > "$WORK/bytes.out" 2>&1 || { cat "$WORK/bytes.out"; fail "the node-strategy run failed"; }
grep -q "on 2 node(s)" "$WORK/bytes.out" || { cat "$WORK/bytes.out"; fail "COMM_TYPE_SHARED did not find 2 hosts"; }
"$PY" - "$WORK/bytes.jsonl" "$NAME-node1" <<'EOF' || fail "kernel bytes and mpidl's counters differ by more than 15 %"
import json, sys
ok = True
for r in (json.loads(l) for l in open(sys.argv[1]) if l.strip()):
    if r.get("event") != "epoch":
        continue
    # Rank 0 (node 1's leader) counts what it hands the inter-node allreduce; between 2
    # leaders a ring (or recursive doubling) sends each its n bytes once, so host 1's wire
    # carries that plus headers and the MPI's own messages; world/control traffic also leaves.
    counted = sum(r["comm"][level]["bytes"] for level in ("inter", "world", "control"))
    wire = r["wire"][sys.argv[2]]["tx_bytes"]
    ratio = wire / counted
    print(f"cluster_stage: epoch {r['epoch']}: host 1 sent {wire} bytes, mpidl counted {counted}: ratio {ratio:.3f}")
    ok &= 0.85 <= ratio <= 1.15
sys.exit(0 if ok else 1)
EOF

# ---- 3. Slurm: two nodes, TERM, resume bitwise
# Every job must start and end as checked, in every run: a job that fails fails the stage,
# with its output (no retry: nothing here is known to fail for a transient reason).
if (( ${#slurm[@]} )); then
    SCRIPT=$REPO/jobs/slurm_cpu_multi_node.sh
    submit() { sbatch --parsable --chdir="$WORK" --output=%x-%j.out --nodes=2 --ntasks-per-node=1 \
                   --cpus-per-task=1 --time=00:10:00 "$@"; }
    exit_code() { scontrol show job "$1" | grep -o 'ExitCode=[0-9:]*' | head -n 1 | cut -d= -f2; }
    wait_gone() {  # wait_gone JOB NAME [SECONDS]: until the job has left the queue, else fail
        local i
        for ((i = 0; i < ${3:-300}; i++)); do
            [[ -z "$(squeue -h -j "$1" -o %i 2>/dev/null)" ]] && return 0
            sleep 1
        done
        scancel "$1" || true
        cat "$WORK/$2-$1.out" >&2 || true
        fail "job $1 ($2) still in the queue after ${3:-300} s"
    }
    ended_0() {  # ended_0 JOB NAME: ExitCode 0:0, else fail with the job's output
        local code
        code=$(exit_code "$1")
        [[ "$code" == 0:0 ]] && return 0
        cat "$WORK/$2-$1.out" >&2 || true
        fail "job $1 ($2) ended with ExitCode $code"
    }
    run_job() {  # run_job NAME ARGS...: submit, wait until it has ended with 0:0; prints the job id
        local name=$1 id
        shift
        id=$(submit --job-name="$name" "$@")
        wait_gone "$id" "$name" >&2
        ended_0 "$id" "$name" >&2
        echo "$id"
    }
    if [[ "$kind" == mpich ]]; then
        # What broke the resumed job's MPI_Init in CI (Slurm's pmi2 plugin cut MPICH's PMI-1
        # lines of more than 1024 bytes: tests/pmi1_probe.py), checked on its own: the launch
        # line of the job scripts (mpidl_slurm_launch) must carry such a line whole between
        # ranks on 2 hosts, every time, whatever bytes MPI_Init happens to send.
        say "3. a PMI-1 request of more than 1024 bytes crosses the job scripts' launch (2 hosts) whole"
        printf '%s\n' '#!/bin/bash' 'set -euo pipefail' "source '$REPO/jobs/launcher.sh'" \
            "mpidl_slurm_launch -- '$PY' '$REPO/tests/pmi1_probe.py'" \
            'echo "launch: ${MPIDL_CMD[*]}"' 'exec "${MPIDL_CMD[@]}"' > "$WORK/pmi1probe.sh"
        job=$(run_job pmi1probe "$WORK/pmi1probe.sh")
        cat "$WORK/pmi1probe-$job.out"
        # Counted as matches, not lines: two ranks' lines may share one in the job's output.
        [[ $(grep -o "came back with 1000 of 1000 characters: whole" "$WORK/pmi1probe-$job.out" | wc -l) == 2 ]] \
            || fail "job $job: the 2 ranks did not both get their peer's value whole"
    fi
    say "3. sbatch --nodes=2 jobs/slurm_cpu_multi_node.sh: straight, then TERM + resume, same model bitwise"
    slurm_args=("${common[@]}" --sync-every 2 --epochs 6)
    job=$(run_job straight "$SCRIPT" "${slurm_args[@]}" --save "$WORK/straight.h5")
    cat "$WORK/straight-$job.out"
    grep -q "2 rank(s) on 2 node(s)" "$WORK/straight-$job.out" || fail "job $job did not run on 2 hosts"
    job=$(submit --job-name=term "$SCRIPT" "${slurm_args[@]}" --checkpoint "$WORK/ck-slurm" --metrics "$WORK/term.jsonl")
    for ((i = 0; i < 600; i++)); do
        grep -qs '"event": "epoch"' "$WORK/term.jsonl" && break
        [[ -n "$(squeue -h -j "$job" -o %i)" ]] || { cat "$WORK/term-$job.out" >&2; fail "job $job ended before training"; }
        sleep 0.2
    done
    scancel --signal=TERM "$job"
    wait_gone "$job" term
    cat "$WORK/term-$job.out"
    ended_0 "$job" term
    end=$(record "$WORK/term.jsonl" end)
    [[ "$end" == *'"stopped": "signal"'* ]] || fail "job $job was not stopped by the signal: $end"
    job=$(run_job resume "$SCRIPT" "${slurm_args[@]}" --checkpoint "$WORK/ck-slurm" --resume --save "$WORK/resumed.h5")
    tail -n 4 "$WORK/resume-$job.out"
    grep -q "resumed from" "$WORK/resume-$job.out" || fail "job $job did not resume"
    "$PY" - "$WORK/straight.h5" "$WORK/resumed.h5" <<'EOF' || fail "the resumed model differs from the straight one"
import sys
import h5py
import numpy as np
def arrays(path):
    out = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: out.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
    return out
a, b = arrays(sys.argv[1]), arrays(sys.argv[2])
assert a.keys() == b.keys() and a, (sorted(a), sorted(b))
same = all(np.array_equal(a[k], b[k]) for k in a)
print(f"cluster_stage: {len(a)} arrays of the final model, bitwise equal: {same}")
sys.exit(0 if same else 1)
EOF
fi

# ---- faults
export MPIDL_FAULT_TIMEOUT=10
BOUND=$((MPIDL_FAULT_TIMEOUT + 30))
# fault_run LABEL ACTION...: trains (40 epochs, checkpoint every epoch) on 2 hosts x 1 rank,
# applies ACTION once the first epoch is recorded, waits for the end; sets ELAPSED, CODE.
fault_run() {
    local label=$1 pid t0
    shift
    rm -rf "$WORK/ck-$label" "$WORK/$label.jsonl"
    mpidl_mpiexec 2 2 "$PY" -m mpidl.train "${common[@]}" --epochs 40 --checkpoint "$WORK/ck-$label" \
        --metrics "$WORK/$label.jsonl"
    "${MPIDL_CMD[@]}" > "$WORK/$label.out" 2>&1 &
    pid=$!
    for ((i = 0; i < 600; i++)); do
        grep -qs '"event": "epoch"' "$WORK/$label.jsonl" && break
        kill -0 "$pid" 2>/dev/null || { cat "$WORK/$label.out"; fail "$label: the job ended before training"; }
        sleep 0.2
    done
    t0=$(now)
    "$@"
    # A job that does not end is ended after 5 minutes (and the check fails).
    local waited=0
    while kill -0 "$pid" 2>/dev/null && (( waited < 3000 )); do sleep 0.1; waited=$((waited + 1)); done
    if kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid"; fi
    CODE=0
    wait "$pid" || CODE=$?
    ELAPSED=$(seconds "$t0" "$(now)")
}
ended_early() {  # the job of $1 has no `end` record: it did not go on as if nothing happened
    [[ "$(record "$WORK/$1.jsonl" end)" == "{}" ]]
}

say "4. fault (a): host 2's link cut for good in training"
fault_run cut bash jobs/cluster.sh --name "$NAME" cut node2
say "(a) link cut: the job ended after $ELAPSED s, exit code $CODE"
grep -aE "node2|TIMEOUT|timed out|lost communication" "$WORK/cut.out" | head -n 5 || true
ended_early cut || fail "(a): the job recorded an end although host 2 was cut off"
awk -v e="$ELAPSED" -v b="$BOUND" 'BEGIN { exit !(e <= b) }' || fail "(a): ended after $ELAPSED s, bound $BOUND s"
bash jobs/cluster.sh --name "$NAME" restore node2
mpidl_mpiexec 2 2 "$PY" -m mpidl.train "${common[@]}" --epochs 3 --checkpoint "$WORK/ck-cut" --resume \
    --metrics "$WORK/cut-resume.jsonl"
"${MPIDL_CMD[@]}" > "$WORK/cut-resume.out" 2>&1 || { cat "$WORK/cut-resume.out"; fail "(a): resuming failed"; }
grep -q "resumed from" "$WORK/cut-resume.out" || fail "(a): the new job did not resume"
[[ "$(record "$WORK/cut-resume.jsonl" end)" == *'"stopped": "completed"'* ]] || fail "(a): the resumed job did not complete"
say "(a) the last checkpoint resumed and the job completed"

say "5. fault (d): every rank of host 2 SIGKILLed"
fault_run kill bash jobs/cluster.sh --name "$NAME" kill node2 KILL
say "(d) ranks killed: the job ended after $ELAPSED s, exit code $CODE"
(( CODE != 0 )) || fail "(d): exit code 0 after ranks were killed"
awk -v e="$ELAPSED" 'BEGIN { exit !(e <= 10) }' || fail "(d): ended after $ELAPSED s, bound 10 s"

# ---- 6. the failure bound (mpidl/distributed/watchdog.py) and the guard (mpidl/guard.py):
# with the MPI's own time-outs off (MPIR_CVAR_PROGRESS_TIMEOUT=0) and launcher flags that make
# it wait for ever (MPICH: -disable-auto-cleanup; Open MPI: a frozen host's daemon), the job
# still ends within --failure-timeout + the guard's grace, with exit code 3 and a line that
# names host 2.
# bound_run LABEL FAULT...: like fault_run, under python -m mpidl.guard, --failure-timeout 10.
bound_run() {
    local label=$1 pid t0 extra=()
    shift
    rm -f "$WORK/$label.jsonl"
    [[ "$kind" == mpich ]] && extra=(-disable-auto-cleanup)
    MPIDL_FAULT_TIMEOUT=0 mpidl_mpiexec 2 2 "$PY" -m mpidl.train "${common[@]}" --epochs 40 --failure-timeout 10 \
        --metrics "$WORK/$label.jsonl"
    "$PY" -m mpidl.guard --grace 10 -- "${MPIDL_CMD[0]}" ${extra[@]+"${extra[@]}"} "${MPIDL_CMD[@]:1}" \
        > "$WORK/$label.out" 2>&1 &
    pid=$!
    for ((i = 0; i < 600; i++)); do
        grep -qs '"event": "epoch"' "$WORK/$label.jsonl" && break
        kill -0 "$pid" 2>/dev/null || { cat "$WORK/$label.out"; fail "$label: the job ended before training"; }
        sleep 0.2
    done
    t0=$(now)
    "$@"
    local waited=0
    while kill -0 "$pid" 2>/dev/null && (( waited < 1200 )); do sleep 0.1; waited=$((waited + 1)); done
    if kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid"; fi
    CODE=0
    wait "$pid" || CODE=$?
    ELAPSED=$(seconds "$t0" "$(now)")
}
bound_checks() {  # bound_checks LABEL WHAT LIMIT: exit code 3, ended within LIMIT s, host 2 named
    say "$2: the job ended after $ELAPSED s, exit code $CODE"
    grep -a "Ending the job" "$WORK/$1.out" | head -n 1 || true
    (( CODE == 3 )) || { cat "$WORK/$1.out"; fail "$2: exit code $CODE, not 3 (the failure bound)"; }
    grep -aq "no heartbeat from rank \[1\] on $NAME-node2" "$WORK/$1.out" || { cat "$WORK/$1.out"; fail "$2: host 2 not named"; }
    awk -v e="$ELAPSED" -v b="$3" 'BEGIN { exit !(e <= b) }' || fail "$2: ended after $ELAPSED s, bound $3 s"
}
if [[ "$kind" == mpich ]]; then
    say "6. the failure bound: every rank of host 2 SIGKILLed under mpiexec -disable-auto-cleanup"
    bound_run bound-kill bash jobs/cluster.sh --name "$NAME" kill node2 KILL
    bound_checks bound-kill "(6) ranks killed, -disable-auto-cleanup" 30
fi
say "6. the failure bound: host 2 frozen for good (--failure-timeout 10, the guard's grace 10 s)"
bound_run bound-freeze bash jobs/cluster.sh --name "$NAME" freeze node2
bash jobs/cluster.sh --name "$NAME" kill node2 KILL >/dev/null || true
bash jobs/cluster.sh --name "$NAME" thaw node2
bound_checks bound-freeze "(6) host frozen" 45

if [[ "${CLUSTER_FAULTS:-}" == all ]]; then
    say "(b) link cut for 3 s, then restored"
    fault_run blip bash -c "bash jobs/cluster.sh --name $NAME cut node2 && sleep 3 && bash jobs/cluster.sh --name $NAME restore node2"
    say "(b) the job ended after $ELAPSED s, exit code $CODE, end record: $(record "$WORK/blip.jsonl" end)"
    say "(c) host 2 frozen for good"
    fault_run freeze bash jobs/cluster.sh --name "$NAME" freeze node2
    say "(c) the job ended after $ELAPSED s, exit code $CODE"
    grep -aE "node2|TIMEOUT|timed out|lost communication" "$WORK/freeze.out" | head -n 5 || true
    bash jobs/cluster.sh --name "$NAME" thaw node2
    say "(e) host 2's link lowered to 50 Mbit/s"
    fault_run slow bash jobs/cluster.sh --name "$NAME" link node2 50mbit
    say "(e) the job ended after $ELAPSED s, exit code $CODE, end record: $(record "$WORK/slow.jsonl" end)"
    bash jobs/cluster.sh --name "$NAME" link node2 1gbit
fi

if [[ "$kind" == openmpi && "${CLUSTER_FAULTS:-}" == all ]]; then
    say "7. grow back (Open MPI, ULFM) on cluster ${NAME:0:7}g: a rank on each of hosts 1 and 2, host 2's rank killed at step 4, 1 rank joins on spare host 3 (--replace-with); final parameters = a fault-free run (<= 1e-12)"
    GROW=${NAME:0:7}g  # a cluster name has at most 8 characters
    bash jobs/cluster.sh --name "$GROW" start --hosts 3 --ranks 2 --rate 1gbit
    MPIDL_CLUSTER=$GROW "$PY" -m pytest -q -p no:cacheprovider tests/test_grow.py -k spare_host \
        || fail "growing back onto spare host 3 failed"
    bash jobs/cluster.sh --name "$GROW" stop
else
    say "7. grow back not run: it needs Open MPI with ULFM and CLUSTER_FAULTS=all (Open MPI's daemon aborts in some runs: see the header)"
fi

say "all cluster checks passed ($kind)"
