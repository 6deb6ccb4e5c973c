"""What the manager and the clients share: devices, config, units, errors and the wire protocol."""

from hybridps.common.config import PRECISIONS, Config
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
from hybridps.common.units import format_bytes, parse_bytes

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
