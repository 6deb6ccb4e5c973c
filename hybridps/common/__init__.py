"""What the manager and the clients share: devices, config, units, errors and the wire protocol."""

from hybridps.common.devices import DeviceInventory, DeviceSpec, canonical_device_name
from hybridps.common.errors import (
    CapacityError,
    ConfigError,
    HybridPSError,
    ManagerError,
    ProtocolError,
    RegistrationError,
    StateError,
)
from hybridps.common.lazy import lazy_exports
from hybridps.common.units import format_bytes, parse_bytes

# the config needs torch (its dtypes); the manager imports this package and never needs
# either, so they are imported on first use ([Note: a lazy package] in hybridps/__init__.py)
__getattr__, __dir__ = lazy_exports(
    __name__, {"Config": "hybridps.common.config", "PRECISIONS": "hybridps.common.config"}, globals()
)


__all__ = [
    "PRECISIONS",
    "CapacityError",
    "Config",
    "ConfigError",
    "DeviceInventory",
    "DeviceSpec",
    "HybridPSError",
    "ManagerError",
    "ProtocolError",
    "RegistrationError",
    "StateError",
    "canonical_device_name",
    "format_bytes",
    "parse_bytes",
]
