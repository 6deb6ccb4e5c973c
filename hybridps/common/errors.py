"""The exceptions HybridPS raises. Every message names the offending value and the fix.

Each class also derives from the builtin that callers would naturally catch (ValueError for
bad configuration, RuntimeError for state and memory failures, KeyError-like LookupError for
unknown parameters), so generic handlers keep working.
"""

from __future__ import annotations


class HybridPSError(Exception):
    """Base class of every HybridPS error."""


class ConfigError(HybridPSError, ValueError):
    """A configuration value is invalid or inconsistent with the machine or the model."""


class CapacityError(HybridPSError, RuntimeError):
    """Model data cannot be placed: a device (or every device) has no room left."""


class StateError(HybridPSError, RuntimeError):
    """A tensor state change that the state machine does not allow, or an API call out of order."""


class RegistrationError(HybridPSError, LookupError):
    """A parameter is unknown to the client, or registered in a way that cannot work."""


class ManagerError(HybridPSError, RuntimeError):
    """The node manager refused a request or could not be reached."""

    def __init__(self, message: str, code: str = "error"):
        super().__init__(message)
        self.code = code


class ProtocolError(HybridPSError, ValueError):
    """A wire message is malformed, of an unknown version or of an unknown kind."""

    def __init__(self, message: str, code: str = "bad_request"):
        super().__init__(message)
        self.code = code


class DiskError(HybridPSError, RuntimeError):
    """The disk tier's scratch file failed: an I/O error, a read that failed its checks (the
    file removed, replaced or truncated, a checksum), a wait past its timeout, or a second
    owner of the same file. ``errno`` is the OS error's number where one caused it."""

    def __init__(self, message: str, errno: int | None = None):
        super().__init__(message)
        self.errno = errno
