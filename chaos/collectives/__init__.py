"""Data-plane collectives: allreduce over ZeroMQ between training processes.

:class:`Communicator` runs a chunked ring or a pipelined tree allreduce over the links of a
:class:`Topology` (built from the scheduler's sync policy with
:func:`topology_from_sync_policy`). See ``docs/collectives.md``.
"""

from chaos.collectives.communicator import CollectiveStats, Communicator, CommunicatorConfig
from chaos.collectives.compress import ErrorFeedback
from chaos.collectives.topology import Topology, topology_from_sync_policy
from chaos.errors import PeerFailure, PeerTimeout

__all__ = [
    "CollectiveStats",
    "Communicator",
    "CommunicatorConfig",
    "ErrorFeedback",
    "PeerFailure",
    "PeerTimeout",
    "Topology",
    "topology_from_sync_policy",
]
