"""Where a rank's libraries listen: the interface of the address the pool is given (--worker-host).

gloo (the CPU collectives and the GPU pools' agreement group) and NCCL's bootstrap open listening
sockets on the interface their ``*_SOCKET_IFNAME`` names, else on one they pick themselves (the
host name's address). UCX, under NIXL, listens on every network device ``UCX_NET_DEVICES`` allows,
all of them by default. The launcher gives its ranks the interface of the worker host, so that
nothing listens beyond it; a variable already set in the environment is kept (an operator's
choice). UCX is restricted only to a loopback host: on a cluster its device list must keep the
RDMA NICs (docs/serving.md, "Ports").
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Mapping

import psutil

SOCKET_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
UCX_DEVICES_VAR = "UCX_NET_DEVICES"


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        pass
    try:
        return ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError):
        return None


def interface_of(host: str) -> str | None:
    """The name of the network interface that has ``host``'s address (None for an address no
    interface has, such as 0.0.0.0)."""
    address = _address(host)
    if address is None or address.is_unspecified:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        for addr in addrs:
            if addr.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            try:
                if ipaddress.ip_address(addr.address.split("%")[0]) == address:
                    return name
            except ValueError:
                continue
    return None


def rank_network_env(host: str, environ: Mapping[str, str]) -> dict[str, str]:
    """Variables that keep the ranks' gloo, NCCL and (on a loopback host) UCX listeners on
    ``host``'s interface; those ``environ`` already sets are left out."""
    name = interface_of(host)
    if name is None:
        return {}
    env = {var: name for var in SOCKET_IFNAME_VARS if var not in environ}
    address = _address(host)
    if address is not None and address.is_loopback and UCX_DEVICES_VAR not in environ:
        env[UCX_DEVICES_VAR] = name
    return env
