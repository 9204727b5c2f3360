"""How a replica group fails for reasons outside its settings: no quorum from the lighthouse."""

from __future__ import annotations

from plait.mesh.errors import InfrastructureFault


class QuorumFault(InfrastructureFault):
    """No quorum: the lighthouse was unreachable, or too few replica groups joined in time.

    One line naming the lighthouse's address; an InfrastructureFault, so `plait-train` exits 74
    and the scheduler may requeue the group (it rejoins and takes the live state from a peer)."""
