"""MPI tests of mpidl.distributed.topology; any world size.

mpiexec -n 4 -hosts localhost:2,127.0.0.1:2 -launcher fork python -m pytest --with-mpi -q tests/mpi   (MPICH)
MPIDL_RANKS_PER_NODE=2 mpiexec -n 4 --oversubscribe python -m pytest --with-mpi -q tests/mpi  (Open MPI)
(bash tests/run_all.sh mpi runs every launch of these tests, for the MPI of mpi4py.)

Every check is computed on every rank, gathered, and only then asserted, so a failure on one
rank never leaves the others waiting in a collective.
"""

import math

import pytest
from mpi4py import MPI

from mpidl import settings
from mpidl.distributed.topology import Topology

#: the variable; mpidl reads it once, into mpidl.settings.SETTINGS (never os.environ later)
RANKS_PER_NODE_ENV = "MPIDL_RANKS_PER_NODE"

pytestmark = pytest.mark.mpi

WORLD = MPI.COMM_WORLD


def failures_anywhere(checks: dict) -> dict:
    """{rank: [names of failed checks]} over all ranks (collective)."""
    failed = [name for name, ok in checks.items() if not ok]
    gathered = WORLD.allgather(failed)
    return {r: f for r, f in enumerate(gathered) if f}


def structural_checks(topo: Topology) -> dict:
    """Invariants every topology must satisfy (collective over the world)."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    node_members = topo.node.allgather(rank)
    node_of_rank_everywhere = WORLD.allgather(topo.node_of_rank)
    leaders_in_world = WORLD.allreduce(int(topo.is_leader))
    lowest = [min(topo.ranks_of_node(n)) for n in range(topo.num_nodes)]
    checks = {
        "rank/size": (topo.rank, topo.size) == (rank, size),
        "node sizes sum to world": sum(topo.node_sizes) == size,
        "node_of_rank has one entry per rank": len(topo.node_of_rank) == size,
        "node_of_rank identical on all ranks": all(x == topo.node_of_rank for x in node_of_rank_everywhere),
        "node comm holds exactly this node's ranks": node_members == topo.node_ranks,
        "node_id matches node_of_rank": topo.node_of_rank[rank] == topo.node_id,
        "local rank / size": (topo.local_rank, topo.local_size)
        == (topo.node.Get_rank(), topo.node_sizes[topo.node_id]),
        "leader is the lowest rank of its node": topo.is_leader == (rank == topo.node_ranks[0]),
        "one leader per node": leaders_in_world == topo.num_nodes,
        "nodes numbered by lowest rank": lowest == sorted(lowest) and len(set(lowest)) == len(lowest),
        "every node non-empty": all(s >= 1 for s in topo.node_sizes),
    }
    if topo.is_leader:
        checks["leaders comm size == num_nodes"] = topo.leaders.Get_size() == topo.num_nodes
        checks["leaders rank == node_id"] = topo.leaders.Get_rank() == topo.node_id
    else:
        checks["non-leaders get COMM_NULL"] = topo.leaders == MPI.COMM_NULL
    return checks


def test_default_topology_invariants():
    topo = Topology.from_comm()
    checks = structural_checks(topo)
    k = settings.SETTINGS.ranks_per_node
    if k is not None:  # the launch asked for emulated nodes
        checks["env grouping rank // K"] = topo.node_of_rank == [r // k for r in range(topo.size)]
        checks["describe says EMULATED"] = "EMULATED" in topo.describe()
    else:
        checks["describe says shared-memory"] = "shared-memory" in topo.describe()
    topo.free()
    assert failures_anywhere(checks) == {}


@pytest.mark.parametrize("ranks_per_node", [1, 2, 3])
def test_ranks_per_node_groups_consecutive_ranks(ranks_per_node):
    topo = Topology.from_comm(ranks_per_node=ranks_per_node)
    size = WORLD.Get_size()
    checks = structural_checks(topo)
    checks["grouping rank // K"] = topo.node_of_rank == [r // ranks_per_node for r in range(size)]
    checks["num_nodes == ceil(P / K)"] = topo.num_nodes == math.ceil(size / ranks_per_node)
    # the last node is smaller when K does not divide P (nodes of different sizes)
    expected_sizes = [min(ranks_per_node, size - start) for start in range(0, size, ranks_per_node)]
    checks["node sizes"] = topo.node_sizes == expected_sizes
    checks["emulated recorded"] = topo.emulated_ranks_per_node == ranks_per_node
    topo.free()
    assert failures_anywhere(checks) == {}


def with_environment(monkeypatch, value: str) -> None:
    """This process's settings as if the launch had set MPIDL_RANKS_PER_NODE=value."""
    monkeypatch.setattr(settings, "SETTINGS", settings.Settings.from_environ({RANKS_PER_NODE_ENV: value}))


def test_environment_variable_and_explicit_argument(monkeypatch):
    with_environment(monkeypatch, "1")
    from_env = Topology.from_comm()
    explicit = Topology.from_comm(ranks_per_node=WORLD.Get_size())  # the argument wins
    checks = {
        "env: one rank per node": from_env.num_nodes == WORLD.Get_size(),
        "argument beats env: one node": explicit.num_nodes == 1,
    }
    from_env.free()
    explicit.free()
    assert failures_anywhere(checks) == {}


@pytest.mark.parametrize("bad", [0, -2, 2.5, True, "two"])
def test_bad_ranks_per_node_is_refused_on_every_rank(bad):
    # raised before any collective, on every rank alike, so nobody is left waiting
    with pytest.raises(ValueError, match="ranks_per_node"):
        Topology.from_comm(ranks_per_node=bad)


def test_bad_environment_value_names_the_variable(monkeypatch):
    with_environment(monkeypatch, "zero")
    with pytest.raises(ValueError, match=RANKS_PER_NODE_ENV):
        Topology.from_comm()


def test_the_environment_is_read_once(monkeypatch):
    """A change of os.environ after start-up changes nothing: the settings were read at
    import, alike on every rank (a rank-dependent late change could split the world)."""
    launched = Topology.from_comm()
    late = "1" if launched.num_nodes != WORLD.Get_size() else str(WORLD.Get_size())
    monkeypatch.setenv(RANKS_PER_NODE_ENV, late)  # too late: settings were read at import
    again = Topology.from_comm()
    checks = {"same nodes": again.node_of_rank == launched.node_of_rank,
              "same emulation": again.emulated_ranks_per_node == launched.emulated_ranks_per_node}
    launched.free()
    again.free()
    assert failures_anywhere(checks) == {}


def test_sub_communicator_and_free_twice():
    # a topology of a sub-communicator (the even and odd world ranks): node ids are local
    half = WORLD.Split(color=WORLD.Get_rank() % 2, key=WORLD.Get_rank())
    topo = Topology.from_comm(half, ranks_per_node=1)
    checks = {
        "size of sub-communicator": topo.size == half.Get_size(),
        "one node per rank": topo.node_sizes == [1] * half.Get_size(),
        "world is the given comm": topo.world is half,
    }
    topo.free()
    topo.free()  # harmless
    checks["freed"] = topo.node == MPI.COMM_NULL and topo.leaders == MPI.COMM_NULL
    checks["local rank kept after free"] = topo.local_rank == 0 and topo.is_leader
    half.Free()
    assert failures_anywhere(checks) == {}
