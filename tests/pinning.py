"""A stand-in for cudaHostRegister: what a real GPU's host arena would pin, recorded."""


class RecordingRegistrar:
    """Records the ranges a host arena registers and unregisters (``arena.HostRegistrar``)."""

    def __init__(self, succeeds: bool = True):
        self.succeeds = succeeds
        self.registered: dict[int, int] = {}  # address -> bytes, while registered
        self.calls = 0

    def register(self, address: int, nbytes: int) -> bool:
        self.calls += 1
        if self.succeeds:
            assert address not in self.registered, "a segment is registered once"
            self.registered[address] = nbytes
        return self.succeeds

    def unregister(self, address: int) -> None:
        del self.registered[address]
