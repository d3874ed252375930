"""Where the servers listen: loopback by default, and a loud warning for anything else.

The ``tritonserver`` that this package runs comes from the ``nvidia-pytriton`` wheel;
nvidia-pytriton 0.7.0 ships Triton 2.51, older than Triton release 25.07, which fixed
CVE-2025-23319, CVE-2025-23320 and CVE-2025-23334 (the Python backend's shared memory) and
CVE-2025-23310 and CVE-2025-23311 (HTTP chunked encoding). That server is fine behind
127.0.0.1; anything other machines can reach should run a Triton of release 25.07 or newer.
"""

import ipaddress
import logging
import socket
import warnings
from importlib import metadata
from typing import Optional, Sequence

from merlin_t4r_ops.errors import ExposedServerWarning

__all__ = ["LOOPBACK", "ADDRESS_FLAGS", "is_loopback", "warn_if_exposed", "flag_value",
           "has_flag", "warn_for_addresses"]

LOOPBACK = "127.0.0.1"
ADDRESS_FLAGS = ("--http-address", "--grpc-address", "--metrics-address")
LOGGER = logging.getLogger(__name__)


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` names is a loopback address (``127.0.0.0/8``, ``::1``)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name, such as "localhost": judge what it resolves to
        pass
    try:
        resolved = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except (OSError, UnicodeError):
        return False
    return bool(resolved) and all(
        ipaddress.ip_address(address.split("%")[0]).is_loopback for address in resolved
    )


def _pytriton_version() -> str:
    try:
        return metadata.version("nvidia-pytriton")
    except metadata.PackageNotFoundError:
        return "unknown"


def exposure_message(host: str) -> str:
    """What the warning for binding ``host`` says: the risk, the CVEs, what to use instead."""
    return (
        f"tritonserver will listen on {host!r}, which other machines may reach. The "
        f"tritonserver that merlin-t4r-ops runs is the one in nvidia-pytriton "
        f"{_pytriton_version()} (nvidia-pytriton 0.7.0 holds Triton 2.51): it predates Triton "
        "release 25.07 and its fixes for CVE-2025-23319, CVE-2025-23320 and CVE-2025-23334 "
        "(Python backend shared memory) and CVE-2025-23310 and CVE-2025-23311 (HTTP chunked "
        "encoding). Keep it on 127.0.0.1, and serve anything reachable from other machines "
        "with Triton 25.07 or newer (for example the NGC container "
        "nvcr.io/nvidia/tritonserver:25.07-py3 or later, with merlin-t4r-ops installed in it)."
    )


def warn_if_exposed(host: str, stacklevel: int = 3) -> bool:
    """Warn (``ExposedServerWarning``, and the log) when ``host`` is not loopback.

    Returns
    -------
    bool
        Whether it warned.
    """
    if is_loopback(host):
        return False
    message = exposure_message(host)
    warnings.warn(message, ExposedServerWarning, stacklevel=stacklevel)
    # An application that configured logging sees it in its logs too; without handlers the
    # warning above already went to stderr, and logging's last resort would repeat it.
    if LOGGER.hasHandlers():
        LOGGER.warning("%s", message)
    return True


def has_flag(args: Sequence[str], flag: str) -> bool:
    """Whether ``args`` hold ``flag``, as ``--flag value`` or ``--flag=value``."""
    return any(a == flag or a.startswith(flag + "=") for a in args)


def flag_value(args: Sequence[str], flag: str) -> Optional[str]:
    """The value of ``--flag=value`` or ``--flag value`` in ``args``, the last one winning."""
    value = None
    for index, arg in enumerate(args):
        if arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
        elif arg == flag and index + 1 < len(args):
            value = args[index + 1]
    return value


def warn_for_addresses(command: Sequence[str], stacklevel: int = 4) -> None:
    """Warn once for each address that a ``tritonserver`` ``command`` binds beyond loopback.

    ``tritonserver`` takes the last of a repeated flag, so an address in a caller's extra
    arguments, appended after the launcher's own, is the one it binds, and is checked.
    """
    addresses = {flag_value(command, flag) for flag in ADDRESS_FLAGS} - {None}
    for address in sorted(addresses):
        warn_if_exposed(address, stacklevel=stacklevel)
