#!/usr/bin/env bash
# jobs/cluster_ssh.sh [SSH OPTIONS] HOST COMMAND...   -- ssh's stand-in for the hosts of jobs/cluster.sh
#
# MPICH's hydra (`-launcher ssh -launcher-exec jobs/cluster_ssh.sh`) and Open MPI's prterun
# (`--prtemca plm_ssh_agent jobs/cluster_ssh.sh`) start their proxy on each host as
# `ssh [OPTIONS] HOST COMMAND...`; this drops ssh's options and runs COMMAND through the shell
# inside HOST (`jobs/cluster.sh run`: its network, UTS and mount namespaces and its cgroups).
# HOST is NAME-nodeI, so the cluster NAME comes from the host name. The proxy is a process
# of this machine, so the launcher's own signals reach it whatever the state of HOST's link.
set -euo pipefail
while (( $# )) && [[ "$1" == -* ]]; do
    case "$1" in
        # ssh options that take a value
        -[bcDEeFIiJLlmOoPpQRSWw]) shift 2 ;;
        *) shift ;;
    esac
done
(( $# >= 2 )) || { echo "cluster_ssh.sh: usage: cluster_ssh.sh [SSH OPTIONS] HOST COMMAND..." >&2; exit 255; }
host=$1; shift
[[ "$host" == *-node* ]] || { echo "cluster_ssh.sh: '$host' is not a host of a jobs/cluster.sh cluster (NAME-nodeI)" >&2; exit 255; }
exec bash "$(dirname "${BASH_SOURCE[0]}")/cluster.sh" --name "${host%%-node*}" run "$host" -- sh -c "$*"
