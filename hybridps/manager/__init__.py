"""The node authority over memory: ledger, placement policy, embedded manager and daemon."""

from hybridps.manager.embedded import EmbeddedManager, ManagerConnection
from hybridps.manager.ledger import Ledger
from hybridps.manager.policy import schedule

__all__ = ["EmbeddedManager", "Ledger", "ManagerConnection", "schedule"]
