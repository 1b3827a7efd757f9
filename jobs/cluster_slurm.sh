#!/usr/bin/env bash
# bash jobs/cluster_slurm.sh NAME start|stop   -- a Slurm on the hosts of cluster NAME
#
# Called by `jobs/cluster.sh start --slurm` (and its stop): slurmctld on the head (in this
# machine's own network namespace, listening on port 6900 + the cluster's subnet byte, so that
# the Slurm of jobs/local_slurm.sh and another cluster's can run beside it) and one
# `slurmd -N NAME-nodeI` inside each host, so Slurm sees N nodes, each with its own address and
# host name; sbatch's batch script and srun's tasks run inside the hosts. Clients use it with
# SLURM_CONF=/run/mpidl-cluster/NAME/slurm.conf (`eval "$(bash jobs/cluster.sh env)"`).
# Debian's packages (munge, slurmctld, slurmd, slurm-client, libpmix-dev for srun --mpi=pmix)
# are installed when missing (root + apt-get), by jobs/slurm_packages.sh as for
# jobs/local_slurm.sh. Everything it writes is in the cluster's state folder, and everything
# it starts is stopped by `jobs/cluster.sh stop`: slurmctld by its pid file there, the slurmds
# with the hosts' processes, munged only if this script started it and no other cluster's
# Slurm nor jobs/local_slurm.sh's is up.
set -euo pipefail
NAME=${1:?usage: cluster_slurm.sh NAME start|stop}
ACTION=${2:?usage: cluster_slurm.sh NAME start|stop}
JOBS_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
STATE=/run/mpidl-cluster/$NAME
CONF=$STATE/slurm.conf
say() { echo "cluster_slurm: $*"; }
alive() { pgrep -x -r D,R,S,I "$1" >/dev/null; }

# shellcheck disable=SC1091
source "$STATE/cluster.env"
# shellcheck source=jobs/slurm_packages.sh
source "$JOBS_DIR/slurm_packages.sh"

start() {
    mpidl_slurm_install_packages
    local head port i
    head=$(hostname -s)
    port=$((6900 + SUBNET))
    mkdir -p "$STATE/slurm/ctld"
    {
        echo "# written by mpidl jobs/cluster_slurm.sh for cluster $NAME"
        echo "ClusterName=mpidl-$NAME"
        # slurmctld runs on the head, reached by the hosts at the bridge's address.
        echo "SlurmctldHost=$head($HEAD_ADDR)"
        echo "SlurmctldPort=$port"
        echo "SlurmdPort=6818"
        echo "SlurmUser=root"
        echo "SlurmdUser=root"
        echo "AuthType=auth/munge"
        echo "StateSaveLocation=$STATE/slurm/ctld"
        # %n: each slurmd (one per host, all on this machine) its own spool, pid and log.
        echo "SlurmdSpoolDir=$STATE/slurm/d-%n"
        echo "SlurmctldPidFile=$STATE/slurmctld.pid"
        echo "SlurmdPidFile=$STATE/slurm/slurmd-%n.pid"
        echo "SlurmctldLogFile=$STATE/slurm/slurmctld.log"
        echo "SlurmdLogFile=$STATE/slurm/slurmd-%n.log"
        # The smallest configuration that needs no cgroup plugin (the hosts' cgroups are the
        # cluster's own): processes found by parentage, no task binding, no accounting.
        echo "ProctrackType=proctrack/linuxproc"
        echo "TaskPlugin=task/none"
        echo "JobAcctGatherType=jobacct_gather/none"
        echo "AccountingStorageType=accounting_storage/none"
        echo "SwitchType=switch/none"
        echo "MpiDefault=none"
        echo "SchedulerType=sched/backfill"
        echo "SelectType=select/cons_tres"
        echo "SelectTypeParameters=CR_CPU"
        echo "SlurmdParameters=config_overrides"
        echo "ReturnToService=2"
        echo "KillWait=10"
        echo "InactiveLimit=0"
        echo "MinJobAge=300"
        for ((i = 1; i <= HOSTS; i++)); do
            echo "NodeName=$NAME-node$i NodeAddr=10.77.$SUBNET.$((10 + i)) CPUs=$RANKS RealMemory=1000 State=UNKNOWN"
        done
        echo "PartitionName=$NAME Nodes=$NAME-node[1-$HOSTS] Default=YES MaxTime=INFINITE State=UP"
    } > "$CONF.tmp"
    mv "$CONF.tmp" "$CONF"
    # srun --mpi=pmix makes a client folder per job step named by job and step only, under
    # /tmp by default: the hosts share /tmp, so the second host's slurmstepd fails ("File
    # exists"). Each host sees its own folder at $STATE/local (jobs/cluster.sh).
    echo "PMIxCliTmpDirBase=$STATE/local" > "$STATE/mpi.conf"
    export SLURM_CONF=$CONF
    if ! alive munged; then
        mkdir -p /run/munge && chown munge:munge /run/munge
        if [[ ! -s /etc/munge/munge.key ]]; then
            mungekey --create --keyfile /etc/munge/munge.key
            chown munge:munge /etc/munge/munge.key && chmod 600 /etc/munge/munge.key
        fi
        runuser -u munge -- /usr/sbin/munged
        cat /run/munge/munged.pid > "$STATE/munged.started"
    fi
    slurmctld
    for ((i = 1; i <= HOSTS; i++)); do
        bash "$JOBS_DIR/cluster.sh" --name "$NAME" run "node$i" -- slurmd -N "$NAME-node$i"
    done
    local state
    for ((i = 0; i < 60; i++)); do
        state=$(sinfo -h -o %T 2>/dev/null | sort -u | tr '\n' ' ')
        if [[ "$state" == "idle " ]]; then
            say "Slurm of cluster $NAME is up: $(sinfo -h -o '%P %D %N %T')"
            return 0
        fi
        sleep 1
    done
    say "the nodes did not become idle (state: $state); logs in $STATE/slurm" >&2
    tail -n 20 "$STATE"/slurm/*.log >&2 || true
    return 1
}

stop() {
    # slurmctld and the slurmds go with `cluster.sh stop` (pid file, the hosts' processes);
    # munged only if started here and no other cluster has a Slurm.
    if [[ -f "$STATE/munged.started" ]]; then
        local other
        other=$(grep -l '^SLURM=1' /run/mpidl-cluster/*/cluster.env 2>/dev/null | grep -v "^$STATE/" || true)
        # jobs/local_slurm.sh's slurmctld (its pid file) needs munged too.
        local local_ctld=""
        [[ -f /run/mpidl-slurm/slurmctld.pid ]] && local_ctld=$(cat /run/mpidl-slurm/slurmctld.pid)
        if [[ -z "$other" ]] && ! { [[ -n "$local_ctld" ]] && kill -0 "$local_ctld" 2>/dev/null; }; then
            kill "$(cat "$STATE/munged.started")" 2>/dev/null || true
        fi
        rm -f "$STATE/munged.started"
    fi
}

case "$ACTION" in
    start) start ;;
    stop) stop ;;
    *) echo "usage: cluster_slurm.sh NAME start|stop" >&2; exit 2 ;;
esac
