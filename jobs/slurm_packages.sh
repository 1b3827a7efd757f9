# source jobs/slurm_packages.sh   (sourced by jobs/local_slurm.sh and jobs/cluster_slurm.sh)
#
# mpidl_slurm_install_packages: installs what a Slurm of jobs/ needs and is missing, from
# Debian's packages: munge, slurmctld, slurmd, slurm-client and libpmix-dev (`srun --mpi=pmix`).
# Returns 1 with a message on stderr when something is missing and there is no root + apt-get
# to install it. The caller defines `say` (its own prefix on every message).

mpidl_slurm_install_packages() {
    local missing=()
    command -v munged >/dev/null 2>&1 || missing+=(munge)
    command -v slurmctld >/dev/null 2>&1 || missing+=(slurmctld)
    command -v slurmd >/dev/null 2>&1 || missing+=(slurmd)
    command -v sbatch >/dev/null 2>&1 || missing+=(slurm-client)
    # The pmix MPI plugin of Debian's Slurm dlopen()s pmix2/lib/libpmix.so, the unversioned
    # name that only the -dev package installs: without it `srun --mpi=pmix` fails.
    [[ -e /usr/lib/x86_64-linux-gnu/pmix2/lib/libpmix.so ]] || missing+=(libpmix-dev)
    if (( ${#missing[@]} == 0 )); then
        return 0
    fi
    if (( EUID != 0 )) || ! command -v apt-get >/dev/null 2>&1; then
        say "missing ${missing[*]}, and no root + apt-get to install them" >&2
        return 1
    fi
    say "installing ${missing[*]} (Debian packages)"
    # `apt-get update` once per machine: a fresh one has no package lists.
    if [[ ! -f /var/lib/apt/periodic/mpidl-slurm-updated ]]; then
        apt-get update -q >/dev/null
        mkdir -p /var/lib/apt/periodic && touch /var/lib/apt/periodic/mpidl-slurm-updated
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
}
