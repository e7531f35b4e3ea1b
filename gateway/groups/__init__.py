"""Groups over HTTP: the wire schemas, the group service (create, read) and the RULER scorer.

The group life cycle itself (states, transitions, leases) is the store's: store/groups.py.
"""

from gateway.groups.schemas import GroupCreate, GroupOut, GroupPage, RolloutIn, RulerIn
from gateway.groups.scorer import Scorer
from gateway.groups.service import GroupService

__all__ = ["GroupCreate", "GroupOut", "GroupPage", "GroupService", "RolloutIn", "RulerIn", "Scorer"]
