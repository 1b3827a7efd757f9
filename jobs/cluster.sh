#!/usr/bin/env bash
# bash jobs/cluster.sh [--name NAME] COMMAND ...   -- a real cluster of hosts on this one machine
#
# Every host is a network namespace with its own interface eth0, a veth pair into a bridge of
# the head (this machine's own namespace), its own host name (UTS namespace) and its own mount
# namespace (a resolv.conf that fails at once: see below), and its processes run in a cgroup of
# their own (cpu quota, cpuset, freezer). Traffic between hosts crosses the veths and the
# bridge, shaped by `tc tbf` in both directions of each host's link. docs/cluster.md explains
# how MPICH, Open MPI and Slurm run on it.
#
#   start [--hosts N] [--ranks R] [--rate RATE[,RATE...]] [--cpu SHARE[,SHARE...]]
#         [--own-core auto|yes|no] [--subnet X] [--slurm]
#         N hosts (default 2) NAME-node1..NAME-nodeN at 10.77.X.11.., the head (the bridge) at
#         10.77.X.1 as NAME-head; R ranks/CPUs per host (default 2: the MPI host list and
#         Slurm's CPUs); RATE a tc rate per host (default 1gbit; `none` unshaped; one value for
#         all hosts or one per host); SHARE the host's CPU in cores (cgroup cpu quota; `none`,
#         the default, or a share of at least the host's cpuset, for no limit); --own-core: a core of its own per host (cpuset) when
#         the machine has at least N cores (auto, the default); X the third byte of the subnet
#         (default: derived from NAME); --slurm: a slurmctld on the head and a slurmd per host.
#         Idempotent: an identical cluster that is up is left as it is. Any failure removes
#         everything start made.
#   stop                  remove everything: processes of the hosts, daemons, namespaces,
#                         veths, bridge, cgroups, /etc/hosts lines, state (also after a failed
#                         or partial start)
#   check                 whether this machine can run a cluster (else: why not; exit 1)
#   status                the hosts, their links (rate, cut), CPU shares, frozen, processes
#   hosts                 the MPI host list, e.g. mpidl-node1:2,mpidl-node2:2
#   env                   shell lines to export for this cluster: MPIDL_CLUSTER, and with
#                         Slurm SLURM_CONF and the transports of the ranks srun starts
#   run HOST -- CMD...    run CMD inside HOST (net + uts + mount namespaces, cgroups)
#   link HOST RATE        change HOST's link rate (both directions; `none` unshaped)
#   cpu HOST SHARE        change HOST's CPU share (cores; `none` no limit)
#   cut HOST | restore HOST   pull HOST's link out of the bridge (packets of both directions
#                         silently lost, as a cable cut behind a switch) | put it back
#   freeze HOST | thaw HOST   stop | resume every process of HOST (freezer cgroup)
#   kill HOST [SIGNAL]    send SIGNAL (default KILL) to every MPI rank of HOST (the processes
#                         with PMI_RANK, OMPI_COMM_WORLD_RANK or PMIX_RANK in their environment)
# HOST is NAME-nodeI, nodeI or I. NAME (default $MPIDL_CLUSTER, else mpidl: lower-case letters
# and digits, at most 8, so that interface names fit) prefixes everything the cluster makes,
# so that two clusters of different names live side by side, each in its own subnet.
#
# Needs root, network/UTS/mount namespaces (ip netns, unshare, nsenter), tc with the tbf
# qdisc, and cgroup v1 cpu, cpuset and freezer controllers; without one, start refuses and
# says which. tbf limits bandwidth only: this kernel has no netem, so latency and loss cannot
# be injected here (where netem exists: tc qdisc add dev eth0 parent ... netem delay 1ms).
#
# Names: a host cannot reach the machine's nameserver, so a reverse lookup there would wait
# for a DNS time-out (seconds per lookup); the hosts' names go to /etc/hosts, and each host's
# mount namespace sees a resolv.conf naming 127.0.0.1 (nothing listens there: fails at once).
set -euo pipefail

JOBS_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
STATE_ROOT=/run/mpidl-cluster
CG_ROOTS=(/sys/fs/cgroup/cpu /sys/fs/cgroup/cpuset /sys/fs/cgroup/freezer)

die() { echo "cluster.sh: $*" >&2; exit 1; }
say() { echo "cluster: $*"; }
usage() { sed -n '2,40p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

NAME=${MPIDL_CLUSTER:-mpidl}
if [[ "${1:-}" == --name ]]; then NAME=${2:?--name needs a value}; shift 2; fi
[[ "$NAME" =~ ^[a-z][a-z0-9]{0,7}$ ]] || die "cluster name '$NAME': lower-case letters and digits, at most 8, starting with a letter"
STATE=$STATE_ROOT/$NAME
BRIDGE=$NAME-br
CG=mpidl-cluster-$NAME
TAG="# mpidl-cluster $NAME"

# ---------------------------------------------------------------------------- helpers
host_index() {  # NAME-nodeI | nodeI | I  ->  I (checked against the cluster's hosts)
    local h=$1 i
    h=${h#"$NAME"-}; h=${h#node}
    [[ "$h" =~ ^[0-9]+$ ]] || die "no host '$1' in cluster $NAME (hosts: $NAME-node1..$NAME-node${HOSTS:-?})"
    i=$((10#$h))
    if [[ -n "${HOSTS:-}" ]] && (( i < 1 || i > HOSTS )); then
        die "no host '$1' in cluster $NAME (hosts: $NAME-node1..$NAME-node$HOSTS)"
    fi
    echo "$i"
}
netns_of() { echo "$NAME-node$1"; }
veth_of() { echo "$NAME-v$1"; }  # head side; the host side is eth0 inside its namespace
addr_of() { echo "10.77.$SUBNET.$((10 + $1))"; }

load_state() {
    [[ -f "$STATE/cluster.env" ]] || die "cluster $NAME is not up (bash jobs/cluster.sh --name $NAME start)"
    # shellcheck disable=SC1091
    source "$STATE/cluster.env"
}

rate_bits() {  # a tc rate (100mbit, 1gbit, 500kbit, 1000000bit) -> bits per second
    local r=${1,,} n unit
    [[ "$r" =~ ^([0-9]+(\.[0-9]+)?)([kmg]?)(bit|bps)?$ ]] || die "rate '$1': use e.g. 100mbit, 1gbit or none"
    n=${BASH_REMATCH[1]}; unit=${BASH_REMATCH[3]}
    [[ "${BASH_REMATCH[4]}" == bps ]] && die "rate '$1': give bits (mbit, gbit), not bytes"
    awk -v n="$n" -v u="$unit" 'BEGIN { m = (u == "k") ? 1e3 : (u == "m") ? 1e6 : (u == "g") ? 1e9 : 1;
                                        printf "%d", n * m }'
}

shape() {  # shape NETNS_OR_- DEV RATE: tbf on DEV (in NETNS, or the head for -), or none
    local ns=$1 dev=$2 rate=$3 bits burst
    local -a tc=(tc)
    [[ "$ns" != - ]] && tc=(ip netns exec "$ns" tc)
    if [[ "$rate" == none ]]; then
        "${tc[@]}" qdisc del dev "$dev" root 2>/dev/null || true
        return 0
    fi
    bits=$(rate_bits "$rate")
    (( bits >= 8000 )) || die "rate '$rate' below 8 kbit/s"
    # A small bucket: 1 ms of the rate, at least 16 KB. A large one lets a whole gradient
    # message after an idle gap leave at the veth's own speed, unshaped (256 KB at 100 Mbit/s:
    # 308 KB crossed in 5 ms instead of 24.6); a smaller one than 1 ms needs the qdisc's
    # timer to fire more often than a loaded machine does (0.25 ms at 1 Gbit/s: 4 MiB
    # allreduces ran at a seventh of the rate here; 1 ms: near the rate).
    burst=$(( bits / 8 / 1000 ))
    (( burst >= 16384 )) || burst=16384
    "${tc[@]}" qdisc replace dev "$dev" root tbf rate "${bits}bit" burst "$burst" latency 100ms
}

host_cgroups() { local c; for c in "${CG_ROOTS[@]}"; do echo "$c/$CG/node$1"; done; }

cpuset_cores() {  # LIST: the number of CPUs of a cpuset list such as 0-3,6 (0 when empty)
    local n=0 part
    local IFS=,
    for part in $1; do
        if [[ "$part" =~ ^([0-9]+)-([0-9]+)$ ]]; then
            n=$(( n + BASH_REMATCH[2] - BASH_REMATCH[1] + 1 ))
        elif [[ "$part" =~ ^[0-9]+$ ]]; then
            n=$(( n + 1 ))
        fi
    done
    echo "$n"
}

set_cpu_share() {  # I SHARE: cpu quota in cores per period (none: no limit)
    local dir=/sys/fs/cgroup/cpu/$CG/node$1 share=$2 quota
    if [[ "$share" == none ]]; then
        echo -1 > "$dir/cpu.cfs_quota_us"
        return 0
    fi
    [[ "$share" =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "CPU share '$share': a number of cores (e.g. 0.5) or none"
    # A share of at least the host's cpuset is no limit, and a quota there is not free: CFS
    # bandwidth control throttled a one-thread process under a quota of exactly its one core
    # for 0.5-0.6 ms of each 12 ms step (5-7 %, measured: docs/results_cluster.md). So a
    # share of the whole cpuset sets no quota.
    local cores
    cores=$(cpuset_cores "$(cat "/sys/fs/cgroup/cpuset/$CG/node$1/cpuset.cpus" 2>/dev/null)")
    if (( cores > 0 )) && awk -v s="$share" -v c="$cores" 'BEGIN { exit !(s >= c) }'; then
        echo -1 > "$dir/cpu.cfs_quota_us"
        return 0
    fi
    # The quota is enforced per period: a half-core host runs a whole period's half at full
    # speed, then stops. With the kernel's default 100 ms that stop is longer than a training
    # step, so steps alternate between full speed and stalled; with 10 ms the host behaves as
    # a slower core at the scale of a step. The kernel's smallest quota is 1 ms, so shares
    # under 0.1 core get a longer period.
    local period=10000
    quota=$(awk -v s="$share" -v p="$period" 'BEGIN { printf "%d", s * p }')
    if (( quota < 1000 )); then
        period=$(awk -v s="$share" 'BEGIN { printf "%d", 1000 / s + 0.5 }')
        quota=1000
    fi
    (( period <= 1000000 )) || die "CPU share '$share' below 0.001 core"
    echo "$period" > "$dir/cpu.cfs_period_us"
    echo "$quota" > "$dir/cpu.cfs_quota_us"
}

pids_of_host() { cat "/sys/fs/cgroup/freezer/$CG/node$1/cgroup.procs" 2>/dev/null || true; }

hosts_file_edit() {  # hosts_file_edit [LINE...]: drop this cluster's lines, then add LINE...
    # In place (cat >), not by rename: /etc/hosts may be a bind mount. Locked: two clusters
    # may change it at the same time.
    (
        flock 9
        local kept
        kept=$(grep -vF "$TAG" /etc/hosts || true)
        { [[ -n "$kept" ]] && printf '%s\n' "$kept"; for l in "$@"; do printf '%s %s\n' "$l" "$TAG"; done; } > /etc/hosts.mpidl-cluster.tmp
        cat /etc/hosts.mpidl-cluster.tmp > /etc/hosts
        rm -f /etc/hosts.mpidl-cluster.tmp
    ) 9< /etc/hosts
}

# ---------------------------------------------------------------------------- checks
check_machine() {
    local missing=() c
    (( EUID == 0 )) || die "needs root (network namespaces, veths, tc, cgroups); run as root"
    for c in ip tc nsenter unshare flock awk; do
        command -v "$c" >/dev/null 2>&1 || missing+=("$c")
    done
    (( ${#missing[@]} == 0 )) || die "missing commands: ${missing[*]} (Debian: iproute2, util-linux)"
    unshare --net --uts --mount true 2>/dev/null \
        || die "this machine does not allow network/UTS/mount namespaces (unshare --net --uts --mount failed)"
    for c in cpu/cpu.cfs_quota_us cpuset/cpuset.cpus freezer; do
        [[ -e /sys/fs/cgroup/$c ]] || die "no cgroup v1 /sys/fs/cgroup/$c (cpu, cpuset and freezer controllers of cgroup v1 are needed)"
    done
}

check_tbf() {  # in a scratch namespace: the kernel has tbf or it has not
    local ns=$NAME-tbfcheck ok=0
    ip netns add "$ns" || die "cannot create a network namespace (ip netns add)"
    # On the scratch namespace's own loopback (no dummy interfaces needed).
    if ip netns exec "$ns" tc qdisc add dev lo root tbf rate 1mbit burst 16kb latency 100ms 2>/dev/null; then
        ok=1
    fi
    ip netns del "$ns"
    (( ok )) || die "the kernel has no tbf qdisc (tc qdisc add ... tbf failed): link rates cannot be shaped"
}

# ---------------------------------------------------------------------------- stop
stop_cluster() {
    local i ns c pid
    # Daemons of the head (slurmctld) by their pid files.
    for pid in "$STATE"/*.pid; do
        [[ -f "$pid" ]] || continue
        kill "$(cat "$pid")" 2>/dev/null || true
    done
    # Every process of every host: thawed first (a frozen process does not die in cgroup v1),
    # then TERM, then KILL, until the cgroups are empty.
    for c in /sys/fs/cgroup/freezer/"$CG"/node*; do
        if [[ -d "$c" ]]; then echo THAWED > "$c/freezer.state" 2>/dev/null || true; fi
    done
    local sig round left
    for round in TERM TERM KILL KILL KILL KILL KILL KILL KILL KILL; do
        left=0
        for c in /sys/fs/cgroup/freezer/"$CG"/node*; do
            [[ -d "$c" ]] || continue
            for pid in $(cat "$c/cgroup.procs" 2>/dev/null); do
                kill -"$round" "$pid" 2>/dev/null && left=1
            done
        done
        (( left )) || break
        sleep 0.5
    done
    for pid in "$STATE"/*.pid; do
        [[ -f "$pid" ]] || continue
        for i in $(seq 20); do kill -0 "$(cat "$pid")" 2>/dev/null || break; sleep 0.5; done
        kill -KILL "$(cat "$pid")" 2>/dev/null || true
        rm -f "$pid"
    done
    if [[ -f "$STATE/munged.started" ]]; then bash "$JOBS_DIR/cluster_slurm.sh" "$NAME" stop || true; fi
    for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$NAME-(node[0-9]+|tbfcheck)$" || true); do
        ip netns del "$ns" 2>/dev/null || true
    done
    for c in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' | grep -E "^$NAME-(v[0-9]+|br)$" || true); do
        ip link del "$c" 2>/dev/null || true
    done
    for c in "${CG_ROOTS[@]}"; do
        [[ -d "$c/$CG" ]] || continue
        for ns in "$c/$CG"/node*; do if [[ -d "$ns" ]]; then rmdir "$ns" 2>/dev/null || true; fi; done
        rmdir "$c/$CG" 2>/dev/null || echo "cluster.sh: could not remove $c/$CG" >&2
    done
    if [[ -d "$STATE" ]]; then
        for c in "$STATE"/*.uts "$STATE"/*.mnt; do if [[ -e "$c" ]]; then umount "$c" 2>/dev/null || true; fi; done
        if mountpoint -q "$STATE"; then umount "$STATE"; fi
        rm -rf "$STATE"
    fi
    if [[ -f /etc/hosts ]] && grep -qF "$TAG" /etc/hosts; then hosts_file_edit; fi
    rmdir "$STATE_ROOT" 2>/dev/null || true
    return 0
}

# ---------------------------------------------------------------------------- start
start_cluster() {
    local hosts=2 ranks=2 rates=1gbit cpus=none own=auto subnet="" slurm=0
    while (( $# )); do
        case "$1" in
            --hosts) hosts=$2; shift 2 ;;
            --ranks) ranks=$2; shift 2 ;;
            --rate) rates=$2; shift 2 ;;
            --cpu) cpus=$2; shift 2 ;;
            --own-core) own=$2; shift 2 ;;
            --subnet) subnet=$2; shift 2 ;;
            --slurm) slurm=1; shift ;;
            *) die "start: unknown option '$1'" ;;
        esac
    done
    [[ "$hosts" =~ ^[0-9]+$ ]] && (( hosts >= 1 && hosts <= 60 )) || die "--hosts $hosts: 1..60"
    [[ "$ranks" =~ ^[0-9]+$ ]] && (( ranks >= 1 )) || die "--ranks $ranks: >= 1"
    if [[ -z "$subnet" ]]; then
        subnet=$(( $(printf '%s' "$NAME" | cksum | cut -d' ' -f1) % 200 + 20 ))
    fi
    [[ "$subnet" =~ ^[0-9]+$ ]] && (( subnet >= 1 && subnet <= 254 )) || die "--subnet $subnet: 1..254"
    local -a rate_of cpu_of
    IFS=, read -r -a rate_of <<< "$rates"
    IFS=, read -r -a cpu_of <<< "$cpus"
    (( ${#rate_of[@]} == 1 || ${#rate_of[@]} == hosts )) || die "--rate $rates: one rate or one per host ($hosts)"
    (( ${#cpu_of[@]} == 1 || ${#cpu_of[@]} == hosts )) || die "--cpu $cpus: one share or one per host ($hosts)"
    local i r
    for ((i = ${#rate_of[@]}; i < hosts; i++)); do rate_of[i]=${rate_of[0]}; done
    for ((i = ${#cpu_of[@]}; i < hosts; i++)); do cpu_of[i]=${cpu_of[0]}; done
    for r in "${rate_of[@]}"; do [[ "$r" == none ]] || rate_bits "$r" >/dev/null; done
    local cores
    cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
    case "$own" in
        auto) if (( cores >= hosts )); then own=yes; else own=no; fi ;;
        yes) (( cores >= hosts )) || die "--own-core yes: $hosts hosts but $cores cores" ;;
        no) ;;
        *) die "--own-core $own: auto, yes or no" ;;
    esac
    local wanted
    wanted=$(printf 'HOSTS=%s\nRANKS=%s\nSUBNET=%s\nOWN_CORE=%s\nSLURM=%s\nRATES="%s"\nCPUS="%s"\n' \
        "$hosts" "$ranks" "$subnet" "$own" "$slurm" "${rate_of[*]}" "${cpu_of[*]}")
    if [[ -f "$STATE/cluster.env" ]]; then
        if [[ "$(grep -vE '^(#|HEAD_)' "$STATE/cluster.env")" == "$wanted" ]]; then
            say "cluster $NAME is already up with this configuration"
            status_cluster
            return 0
        fi
        die "cluster $NAME is up with another configuration; bash jobs/cluster.sh --name $NAME stop first"
    fi
    check_machine
    if ip -o -4 addr show 2>/dev/null | grep -q " 10\.77\.$subnet\."; then
        die "subnet 10.77.$subnet.0/24 is in use by another interface (another cluster?); pick --subnet"
    fi
    if ip link show "$BRIDGE" >/dev/null 2>&1 || ip netns list | grep -qE "^$NAME-node"; then
        die "leftovers of a cluster $NAME without its state (bash jobs/cluster.sh --name $NAME stop removes them)"
    fi
    check_tbf

    # From here on, any failure removes what was made.
    trap 'code=$?; if (( code != 0 )); then echo "cluster.sh: start failed; removing what it made" >&2; stop_cluster; fi' EXIT
    SUBNET=$subnet HOSTS=$hosts
    mkdir -p "$STATE"
    # A private mount of the state folder, so the namespace files below can be bind targets.
    mount --bind "$STATE" "$STATE"
    mount --make-private "$STATE"
    printf 'nameserver 127.0.0.1\noptions timeout:1 attempts:1\n' > "$STATE/resolv.conf"

    ip link add "$BRIDGE" type bridge
    # A MAC of its own (locally administered, from the subnet). Left to itself a bridge takes
    # the lowest MAC of its ports, and changes it when that port leaves: `cut` of the host
    # whose veth had it left every other host with the head's old MAC in its ARP cache, so
    # that they too lost the head (mpiexec, slurmctld) until the entry went stale, tens of
    # seconds; the cut host's own rank ending the job could not say so in time.
    ip link set "$BRIDGE" address "$(printf '02:00:0a:4d:%02x:01' "$subnet")"
    ip addr add "10.77.$subnet.1/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    local hosts_lines=("10.77.$subnet.1 $NAME-head")
    for c in "${CG_ROOTS[@]}"; do mkdir -p "$c/$CG"; done
    # CPU weight: on a machine shared with other work, the cluster's cgroup is ONE entity of the
    # root's CFS group scheduling, weight 1024 (cpu.shares), the same as one ordinary process,
    # and that weight is split among the hosts (per CPU, by their load). Two busy hosts each
    # got half an ordinary process's share of their core: a rank's step ran about 2x slower
    # in wall time than the same process alone in a host, at the same CPU time (measured:
    # benchmarks/results/cluster_engine.md). Separate machines do not dilute each other, so the
    # cluster weighs as its ranks (1024 each, R per host) and each host as its own R.
    local weight=$(( 1024 * hosts * ranks ))
    (( weight <= 262144 )) || weight=262144  # the kernel's largest cpu.shares
    echo "$weight" > "/sys/fs/cgroup/cpu/$CG/cpu.shares"
    # A cpuset cgroup v1 starts with no cpus and no mems, and a child may only take what its
    # parent has: the cluster's cpuset gets all of the root's before any host's is written.
    cat /sys/fs/cgroup/cpuset/cpuset.mems > "/sys/fs/cgroup/cpuset/$CG/cpuset.mems"
    cat /sys/fs/cgroup/cpuset/cpuset.cpus > "/sys/fs/cgroup/cpuset/$CG/cpuset.cpus"
    local -a cpu_list
    mapfile -t cpu_list < <(awk -F- 'BEGIN { RS = "," } NF { a = $1; b = (NF > 1) ? $2 : $1; for (i = a; i <= b; i++) print i }' /sys/fs/cgroup/cpuset/cpuset.cpus)
    for ((i = 1; i <= hosts; i++)); do
        local ns veth
        ns=$(netns_of "$i"); veth=$(veth_of "$i")
        ip netns add "$ns"
        ip link add "$veth" type veth peer name eth0 netns "$ns"
        ip link set "$veth" master "$BRIDGE"
        ip link set "$veth" up
        ip netns exec "$ns" ip link set lo up
        ip netns exec "$ns" ip addr add "$(addr_of "$i")/24" dev eth0
        ip netns exec "$ns" ip link set eth0 up
        ip netns exec "$ns" ip route add default via "10.77.$subnet.1"
        # A host's TCP gives up on a peer that stopped answering after ~12.6 s of
        # retransmissions (tcp_retries2=5 from a 200 ms RTO) instead of ~15 min, and probes
        # idle keepalive sockets after 5 s (5 probes 1 s apart): what makes an MPI whose
        # transport reports a dead connection (Open MPI's TCP BTL) end the job (docs/cluster.md).
        ip netns exec "$ns" sysctl -q -w net.ipv4.tcp_retries2=5 net.ipv4.tcp_keepalive_time=5 \
            net.ipv4.tcp_keepalive_intvl=1 net.ipv4.tcp_keepalive_probes=5
        # Both directions of the link: the host's egress on its eth0, its ingress on the
        # head's end of the veth.
        shape "$ns" eth0 "${rate_of[i-1]}"
        shape - "$veth" "${rate_of[i-1]}"
        for c in $(host_cgroups "$i"); do mkdir -p "$c"; done
        if [[ "$own" == yes ]]; then
            cat /sys/fs/cgroup/cpuset/cpuset.mems > "/sys/fs/cgroup/cpuset/$CG/node$i/cpuset.mems"
            echo "${cpu_list[i-1]}" > "/sys/fs/cgroup/cpuset/$CG/node$i/cpuset.cpus"
        else
            cat /sys/fs/cgroup/cpuset/cpuset.mems > "/sys/fs/cgroup/cpuset/$CG/node$i/cpuset.mems"
            cat "/sys/fs/cgroup/cpuset/$CG/cpuset.cpus" > "/sys/fs/cgroup/cpuset/$CG/node$i/cpuset.cpus"
        fi
        echo $(( 1024 * ranks > 262144 ? 262144 : 1024 * ranks )) > "/sys/fs/cgroup/cpu/$CG/node$i/cpu.shares"
        set_cpu_share "$i" "${cpu_of[i-1]}"
        # The host's own UTS and mount namespaces, kept by bind mounts on files of $STATE.
        # In it: the host name; the failing resolv.conf; a sysfs of the host's own network
        # namespace (sysfs shows the interfaces of the namespace that mounted it: the host's
        # /sys/class/net must be its eth0), with the machine's /sys/fs/cgroup moved back onto
        # it (slurmd and the cgroups need it; `ip netns exec` loses it).
        touch "$STATE/node$i.uts" "$STATE/node$i.mnt"
        # $STATE/local is the host's own folder (node$i.local): for what must not be shared
        # between hosts although /tmp is (Slurm's PMIx client folders, named by job only).
        mkdir -p "$STATE/node$i.cgroup" "$STATE/node$i.local" "$STATE/local"
        nsenter --net="/var/run/netns/$ns" unshare --uts="$STATE/node$i.uts" --mount="$STATE/node$i.mnt" \
            --propagation private sh -c "hostname '$NAME-node$i' && mount --bind '$STATE/resolv.conf' /etc/resolv.conf \
                && mount --bind '$STATE/node$i.local' '$STATE/local' \
                && mount --rbind /sys/fs/cgroup '$STATE/node$i.cgroup' && mount -t sysfs sysfs /sys \
                && mount --move '$STATE/node$i.cgroup' /sys/fs/cgroup"
        hosts_lines+=("$(addr_of "$i") $NAME-node$i")
    done
    hosts_file_edit "${hosts_lines[@]}"
    { echo "# cluster $NAME, written by jobs/cluster.sh start"; echo "$wanted"
      echo "HEAD_ADDR=10.77.$subnet.1"; echo "HEAD_NAME=$NAME-head"; } > "$STATE/cluster.env.tmp"
    mv "$STATE/cluster.env.tmp" "$STATE/cluster.env"
    if (( slurm )); then
        bash "$JOBS_DIR/cluster_slurm.sh" "$NAME" start
    fi
    trap - EXIT
    say "cluster $NAME is up: $hosts host(s), subnet 10.77.$subnet.0/24"
    status_cluster
}

# ---------------------------------------------------------------------------- status and tools
status_cluster() {
    load_state
    local i ns rate share frozen cut procs q
    echo "cluster $NAME: head $HEAD_NAME ($HEAD_ADDR), bridge $BRIDGE, own core: $OWN_CORE, slurm: $([[ $SLURM == 1 ]] && echo yes || echo no)"
    for ((i = 1; i <= HOSTS; i++)); do
        ns=$(netns_of "$i")
        # An unshaped link (--rate none) has no tbf line: grep finds nothing, which is no error.
        rate=$(ip netns exec "$ns" tc qdisc show dev eth0 2>/dev/null | { grep -o 'tbf.*rate [0-9.]*[KMG]*bit' || true; } | awk '{print $NF}')
        q=$(cat "/sys/fs/cgroup/cpu/$CG/node$i/cpu.cfs_quota_us" 2>/dev/null || echo -1)
        p=$(cat "/sys/fs/cgroup/cpu/$CG/node$i/cpu.cfs_period_us" 2>/dev/null || echo 100000)
        if (( q < 0 )); then share=none; else share=$(awk -v q="$q" -v p="$p" 'BEGIN { printf "%.2f", q / p }'); fi
        frozen=$(cat "/sys/fs/cgroup/freezer/$CG/node$i/freezer.state" 2>/dev/null || echo "?")
        if ip -o link show "$(veth_of "$i")" 2>/dev/null | grep -q "master $BRIDGE"; then cut=connected; else cut=CUT; fi
        procs=$(pids_of_host "$i" | wc -l)
        printf '  %s  %s  link %s %s  cpu %s  cores %s  %s  %s process(es)\n' "$NAME-node$i" "$(addr_of "$i")" \
            "${rate:-unshaped}" "$cut" "$share" "$(cat "/sys/fs/cgroup/cpuset/$CG/node$i/cpuset.cpus" 2>/dev/null)" \
            "$frozen" "$procs"
    done
}

run_in_host() {
    load_state
    local i
    i=$(host_index "$1"); shift
    [[ "${1:-}" == -- ]] && shift
    (( $# )) || die "run: no command"
    local c
    for c in $(host_cgroups "$i"); do echo "$BASHPID" > "$c/cgroup.procs"; done
    exec nsenter --net="/var/run/netns/$(netns_of "$i")" --uts="$STATE/node$i.uts" \
        --mount="$STATE/node$i.mnt" --wd="$PWD" -- "$@"
}

# A cut loses the packets of both directions. Taking the head's end of the veth out of the
# bridge alone lost only what went to the host: the end stayed up in the head's namespace,
# whose IPv4 (rp_filter 0, the machine's default) took what the host sent to a head address
# (the bridge's), so a host cut off still reached mpiexec and slurmctld on the head, with no
# answer back. Hydra then read the first part of a message from the cut host's proxy and
# waited in read() for the rest for ever (the cluster stage's fault (a) ran to its limit).
# So the detached end also gets strict reverse-path filtering (a packet from the host's
# address arriving there, not on the bridge, is dropped) and no IPv6; the host's own eth0
# stays up, as behind a switch.
cut_link() {  # VETH
    ip link set "$1" nomaster
    sysctl -q -w "net.ipv4.conf.$1.rp_filter=1"
    if [[ -e "/proc/sys/net/ipv6/conf/$1/disable_ipv6" ]]; then sysctl -q -w "net.ipv6.conf.$1.disable_ipv6=1"; fi
}
restore_link() {  # VETH
    if [[ -e "/proc/sys/net/ipv6/conf/$1/disable_ipv6" ]]; then sysctl -q -w "net.ipv6.conf.$1.disable_ipv6=0"; fi
    sysctl -q -w "net.ipv4.conf.$1.rp_filter=$(sysctl -n net.ipv4.conf.default.rp_filter)"
    ip link set "$1" master "$BRIDGE"
}

kill_ranks() {
    load_state
    local i sig=${2:-KILL} pid n=0
    i=$(host_index "$1")
    for pid in $(pids_of_host "$i"); do
        if tr '\0' '\n' < "/proc/$pid/environ" 2>/dev/null | grep -qE '^(PMI_RANK|OMPI_COMM_WORLD_RANK|PMIX_RANK)='; then
            kill -"$sig" "$pid" 2>/dev/null && n=$((n + 1))
        fi
    done
    say "SIG$sig sent to $n rank(s) of $NAME-node$i"
}

CMD=${1:-}
[[ -n "$CMD" ]] || usage
shift
case "$CMD" in
    start) start_cluster "$@" ;;
    check)  # exit 0 when this machine can run a cluster, else 1 with the reason
        check_machine
        check_tbf
        say "this machine can run a cluster (root, namespaces, tbf, cgroup v1 cpu/cpuset/freezer)" ;;
    stop)
        check_machine
        stop_cluster
        say "cluster $NAME stopped (nothing of it is left)" ;;
    status) status_cluster ;;
    hosts)
        load_state
        list=""
        for ((i = 1; i <= HOSTS; i++)); do list+="${list:+,}$NAME-node$i:$RANKS"; done
        echo "$list" ;;
    env)
        load_state
        echo "export MPIDL_CLUSTER=$NAME"
        if [[ "$SLURM" == 1 ]]; then
            echo "export SLURM_CONF=$STATE/slurm.conf"
            # For ranks that srun starts (sbatch and srun pass the environment on), what
            # jobs/launcher.sh gives mpiexec on the cluster: MPICH's UCX over TCP on eth0 (its
            # default reaches across the namespaces through shared memory, off the link),
            # its progress time-out; Open MPI's TCP BTL on the cluster's subnet.
            echo "export UCX_TLS=tcp,self UCX_NET_DEVICES=eth0 MPIR_CVAR_PROGRESS_TIMEOUT=\${MPIDL_FAULT_TIMEOUT:-60}"
            echo "export OMPI_MCA_pml=ob1 OMPI_MCA_btl=tcp,sm,self OMPI_MCA_btl_tcp_if_include=10.77.$SUBNET.0/24"
        fi ;;
    run) [[ $# -ge 2 ]] || usage; run_in_host "$@" ;;
    link)
        load_state; i=$(host_index "${1:?link HOST RATE}")
        shape "$(netns_of "$i")" eth0 "${2:?link HOST RATE}"; shape - "$(veth_of "$i")" "$2"
        say "$NAME-node$i link: $2" ;;
    cpu)
        load_state; i=$(host_index "${1:?cpu HOST SHARE}")
        set_cpu_share "$i" "${2:?cpu HOST SHARE}"; say "$NAME-node$i CPU share: $2" ;;
    cut)
        load_state; i=$(host_index "${1:?cut HOST}")
        cut_link "$(veth_of "$i")"; say "$NAME-node$i link cut" ;;
    restore)
        load_state; i=$(host_index "${1:?restore HOST}")
        restore_link "$(veth_of "$i")"; say "$NAME-node$i link restored" ;;
    freeze|thaw)
        load_state; i=$(host_index "${1:?$CMD HOST}")
        if [[ "$CMD" == freeze ]]; then state=FROZEN; else state=THAWED; fi
        echo "$state" > "/sys/fs/cgroup/freezer/$CG/node$i/freezer.state"; say "$NAME-node$i $state" ;;
    kill) kill_ranks "${1:?kill HOST [SIGNAL]}" "${2:-KILL}" ;;
    -h|--help|help) usage ;;
    *) usage ;;
esac
