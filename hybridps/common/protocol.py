"""Wire-level value objects shared by clients and the manager.

``ClientInfo`` says who a client is when it registers with a manager (embedded or daemon).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClientInfo:
    """Who a client is; sent once at registration."""

    rank: int = 0
    local_rank: int = 0
    pid: int = 0
    host: str = ""
    #: Devices this client can place chunks on (the CPU and its GPUs).
    devices: tuple[str, ...] = ()
