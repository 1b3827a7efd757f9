"""Who runs where: the world, node and leader communicators of one job.

Three communicators describe the machine as the reducers see it::

    world    all P ranks                                  (MPI.COMM_WORLD by default)
    node     the ranks that share one node's memory       (Split_type(COMM_TYPE_SHARED))
    leaders  local rank 0 of every node, one per node     (MPI.COMM_NULL on the other ranks)

Nodes are numbered ``0 .. num_nodes-1`` in the order of their lowest world rank, and the
leader of a node is its lowest world rank, so ``leaders.rank == node_id`` on every leader.
Nodes may have different sizes (``-hosts a:2,b:1`` gives 2 + 1).

Emulated nodes. A launcher that puts every rank on one machine gives one node. Setting
``ranks_per_node=K`` (or the environment variable ``MPIDL_RANKS_PER_NODE=K``) instead groups
consecutive world ranks, ``node_id = rank // K``, so a laptop can run the node-based
strategies; the last node is smaller when ``K`` does not divide ``P``. With MPICH, a real
split of one machine is also possible: ``mpiexec -n 4 -ppn 2 -hosts localhost,127.0.0.1
-launcher fork`` makes ``Split_type`` return two groups of two.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mpi4py import MPI

from mpidl import settings



def _ranks_per_node_from(value) -> int | None:
    """An explicit ranks-per-node value, checked, or ``MPIDL_RANKS_PER_NODE``
    (:mod:`mpidl.settings`); None when neither is given (the shared-memory split). Raises
    ValueError for anything that is not an integer >= 1, alike on every rank."""
    if value is None:
        return settings.SETTINGS.ranks_per_node
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"ranks_per_node must be an integer >= 1, got {value!r}")
    return value


@dataclass(eq=False)
class Topology:
    """The world, node and leader communicators, and where every rank sits.

    Attributes
    ----------
    world, node, leaders : MPI.Comm
        ``leaders`` is ``MPI.COMM_NULL`` on ranks that are not a node leader.
    node_id : int
        This rank's node, ``0 .. num_nodes-1`` in order of the nodes' lowest world rank.
    node_sizes : list[int]
        Ranks per node, indexed by node id (sums to ``size``).
    node_of_rank : list[int]
        Node id of every world rank, indexed by world rank (the same list on every rank).
    rank, size : int
        World rank and size.
    local_rank, local_size : int
        Rank within the node and the node's size (kept after :meth:`free`).
    emulated_ranks_per_node : int or None
        ``K`` when nodes were emulated by grouping consecutive ranks, else None.
    """

    world: MPI.Comm
    node: MPI.Comm
    leaders: MPI.Comm
    node_id: int
    node_sizes: list[int]
    node_of_rank: list[int]
    rank: int
    size: int
    local_rank: int
    local_size: int
    emulated_ranks_per_node: int | None = None
    _owned: list = field(default_factory=list, repr=False)

    @classmethod
    def from_comm(cls, comm: MPI.Comm | None = None, ranks_per_node: int | None = None) -> "Topology":
        """Build the topology of ``comm`` (collective over ``comm``).

        Parameters
        ----------
        comm : MPI.Comm, default MPI.COMM_WORLD
        ranks_per_node : int, optional
            Emulate nodes of ``K`` consecutive ranks (``node = rank // K``). When None, the
            environment variable ``MPIDL_RANKS_PER_NODE`` is used if set, else the real
            shared-memory split ``comm.Split_type(MPI.COMM_TYPE_SHARED)``.
        """
        world = MPI.COMM_WORLD if comm is None else comm
        emulated = _ranks_per_node_from(ranks_per_node)
        rank = world.Get_rank()
        # key=rank keeps world order inside each node, so local rank 0 is the node's lowest
        # world rank and the leaders come out ordered by node id.
        if emulated is None:
            node = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        else:
            node = world.Split(color=rank // emulated, key=rank)
        # A node is named by its lowest world rank; every rank learns every rank's node.
        node_lowest_rank = node.allreduce(rank, op=MPI.MIN)
        lowest_of_rank = world.allgather(node_lowest_rank)
        lowest_sorted = sorted(set(lowest_of_rank))
        id_of_lowest = {low: i for i, low in enumerate(lowest_sorted)}
        node_of_rank = [id_of_lowest[low] for low in lowest_of_rank]
        node_sizes = [node_of_rank.count(i) for i in range(len(lowest_sorted))]
        is_leader = node.Get_rank() == 0
        leaders = world.Split(color=0 if is_leader else MPI.UNDEFINED, key=rank)
        owned = [node] + ([leaders] if leaders != MPI.COMM_NULL else [])
        return cls(world=world, node=node, leaders=leaders, node_id=node_of_rank[rank],
                   node_sizes=node_sizes, node_of_rank=node_of_rank,
                   rank=rank, size=world.Get_size(), local_rank=node.Get_rank(),
                   local_size=node.Get_size(),
                   emulated_ranks_per_node=emulated, _owned=owned)

    @property
    def is_leader(self) -> bool:
        return self.local_rank == 0

    @property
    def num_nodes(self) -> int:
        return len(self.node_sizes)

    def ranks_of_node(self, node_id: int) -> list[int]:
        """World ranks of node ``node_id``, ascending (the first one is its leader)."""
        return [r for r, n in enumerate(self.node_of_rank) if n == node_id]

    @property
    def node_ranks(self) -> list[int]:
        """World ranks of this rank's node, ascending."""
        return self.ranks_of_node(self.node_id)

    def describe(self) -> str:
        """One line for the log, e.g. ``4 ranks on 2 nodes [2+2] (shared-memory split); ...``."""
        how = ("shared-memory split" if self.emulated_ranks_per_node is None
               else f"EMULATED nodes of {self.emulated_ranks_per_node} consecutive ranks")
        sizes = "+".join(str(s) for s in self.node_sizes)
        return (f"{self.size} ranks on {self.num_nodes} node{'s' if self.num_nodes != 1 else ''} "
                f"[{sizes}] ({how}); rank {self.rank} is local rank {self.local_rank}/{self.local_size} "
                f"of node {self.node_id}{' (leader)' if self.is_leader else ''}")

    def free(self) -> None:
        """Free the node and leader communicators this topology created (never ``world``).

        Collective over ``world`` in effect (each node / the leaders free together). Calling
        it twice is harmless.
        """
        for comm in self._owned:
            comm.Free()
        self._owned.clear()
        self.node = MPI.COMM_NULL
        self.leaders = MPI.COMM_NULL
