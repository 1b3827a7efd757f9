#!/usr/bin/env bash
# bash jobs/local_slurm.sh [start|stop|status]
#
# A one-machine Slurm on localhost, to run the sbatch scripts of jobs/ for real (the test
# stage tests/slurm_stage.sh uses it). `start` (the default):
#   1. installs what is missing, from Debian's packages: munge, slurmctld, slurmd,
#      slurm-client (`apt-get update` once, then `apt-get install`; root needed);
#   2. writes /etc/slurm/slurm.conf for this machine (its CPUs and memory, one node, one
#      partition `debug`), unless a slurm.conf that this script did not write is there;
#   3. starts munged, slurmctld and slurmd (no systemd needed) and waits until the node is idle.
# `stop` ends the daemons it started; `status` shows sinfo. If a slurmctld already answers
# (`scontrol ping`), `start` uses that Slurm and changes nothing.
#
# The configuration is the smallest that works inside a container without cgroups:
# proctrack/linuxproc (processes found by parentage), task/none, no accounting. The node
# declares Slurm's default `--cpus-per-task=1` CPUs = the machine's, with
# SlurmdParameters=config_overrides so a sandbox that misreports its hardware still starts.
# Debian's Slurm (22.05 in bookworm) has the pmi2 and pmix MPI plugins; pmix needs libpmix at
# run time (libpmix-dev, for the unversioned libpmix.so), which this script installs too.

# Stop at the first failing command and at unset variables.
set -euo pipefail

ACTION=${1:-start}
CONF=/etc/slurm/slurm.conf
MARK="# written by mpidl jobs/local_slurm.sh"
STATE=/var/spool/mpidl-slurm
RUN=/run/mpidl-slurm
LOG=/var/log/mpidl-slurm

say() { echo "local_slurm: $*"; }
# Whether a daemon of that name is alive (zombies, left until their parent reaps them, are not).
alive() { pgrep -x -r D,R,S,I "$1" >/dev/null; }
# Whether this Slurm's own slurmctld or slurmd is alive, by its pid file: a cluster of
# jobs/cluster.sh runs daemons of the same names beside it, which a look by name took for
# these (start then never started its own and waited for a node that could not come).
own_alive() {
    local pid
    pid=$(cat "$RUN/$1.pid" 2>/dev/null) || return 1
    [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$1" ]] || return 1
    ! grep -q '^State:.*Z' "/proc/$pid/status" 2>/dev/null
}

# Whether a slurmctld answers (ours or the site's).
ctld_up() { command -v scontrol >/dev/null 2>&1 && scontrol ping 2>/dev/null | grep -q "is UP"; }

# shellcheck source=jobs/slurm_packages.sh
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/slurm_packages.sh"

write_conf() {
    local host cpus mem
    host=$(hostname -s)
    # nproc honours OMP_NUM_THREADS (CI exports 1): the node's CPUs are the machine's.
    cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
    # RealMemory in MiB, a little below the total so slurmd's own check passes.
    mem=$(awk '/^MemTotal:/ { printf "%d", $2 / 1024 * 0.9 }' /proc/meminfo)
    if [[ -f "$CONF" ]] && ! grep -qF "$MARK" "$CONF"; then
        say "$CONF exists and was not written by this script: left as it is" >&2
        return 1
    fi
    mkdir -p /etc/slurm "$STATE/ctld" "$STATE/d" "$RUN" "$LOG"
    cat > "$CONF.tmp" <<EOF
$MARK for $host ($cpus CPUs, $mem MiB)
ClusterName=mpidl-local
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=30
InactiveLimit=0
MinJobAge=300
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
    mv "$CONF.tmp" "$CONF"
}

start_daemons() {
    mkdir -p /run/munge && chown munge:munge /run/munge
    if ! alive munged; then
        if [[ ! -s /etc/munge/munge.key ]]; then
            mungekey --create --keyfile /etc/munge/munge.key
            chown munge:munge /etc/munge/munge.key && chmod 600 /etc/munge/munge.key
        fi
        runuser -u munge -- /usr/sbin/munged
        mkdir -p "$RUN" && cat /run/munge/munged.pid > "$RUN/munged.started"
    fi
    # Until the node is idle (slurmd registered); a node left DOWN by an earlier run is resumed,
    # and a daemon that was still shutting down when this started is started again.
    local host state deadline=$((SECONDS + 90))
    host=$(hostname -s)
    # 90 s at most, however long each sinfo waits for a controller that does not answer.
    while (( SECONDS < deadline )); do
        own_alive slurmctld || slurmctld
        own_alive slurmd || slurmd
        state=$(sinfo -h -n "$host" -o %T 2>/dev/null || true)
        case "$state" in
            idle*|mixed*|allocated*) say "Slurm is up: node $host $state"; return 0 ;;
            down*|drain*) scontrol update nodename="$host" state=resume 2>/dev/null || true ;;
        esac
        sleep 1
    done
    say "the node did not become idle within 90 s; logs in $LOG" >&2
    tail -n 20 "$LOG/slurmctld.log" "$LOG/slurmd.log" >&2 || true
    return 1
}

case "$ACTION" in
    start)
        if ctld_up && ! { [[ -f "$CONF" ]] && grep -qF "$MARK" "$CONF"; }; then
            say "a slurmctld of this site already answers: using it"
            sinfo
            exit 0
        fi
        mpidl_slurm_install_packages
        write_conf
        start_daemons
        ;;
    stop)
        # Only the daemons of a configuration this script wrote.
        if [[ -f "$CONF" ]] && grep -qF "$MARK" "$CONF"; then
            for pidfile in "$RUN/slurmd.pid" "$RUN/slurmctld.pid"; do
                if [[ -f "$pidfile" ]]; then
                    pid=$(cat "$pidfile")
                    kill "$pid" 2>/dev/null || true
                    # Until it is gone, so that a `start` right after starts a fresh one.
                    for ((i = 0; i < 60; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
                fi
            done
            say "stopped slurmd and slurmctld"
        fi
        # munged only if `start` started it and no cluster of jobs/cluster.sh has a Slurm
        # that still needs it.
        if [[ -f "$RUN/munged.started" ]]; then
            if ! grep -qs '^SLURM=1' /run/mpidl-cluster/*/cluster.env; then
                kill "$(cat "$RUN/munged.started")" 2>/dev/null || true
            fi
            rm -f "$RUN/munged.started"
        fi
        ;;
    status)
        sinfo
        ;;
    *)
        echo "usage: bash jobs/local_slurm.sh [start|stop|status]" >&2
        exit 2
        ;;
esac
