"""A node's IP, chosen as the preset's `ray.node_ip` says: from its name, an interface, an address prefix,
or (TEST MODE) its index on the loopback. The job script probes each node with it (`miles.job.nodes`);
the launcher previews a role plan with it (`launcher roles`)."""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from collections.abc import Callable, Sequence

SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address
IP_MODES = ("hostname", "loopback-index", "interface", "prefix")
REMOTE_IP_MODES = ("interface", "prefix")  # need a probe on each node


class NodeIpError(ValueError):
    """A node's IP cannot be chosen as the preset asks."""


def loopback_ip(index: int) -> str:
    """TEST MODE: node `index` of the allocation -> 127.0.0.(2+index) (Ray rewrites 127.0.0.1)."""
    if not 0 <= index <= 252:
        raise NodeIpError(f"loopback-index mode supports at most 253 nodes, got index {index}")
    return f"127.0.0.{2 + index}"


def hostname_ip(name: str) -> str:
    """The first IPv4 address a node name resolves to."""
    try:
        infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise NodeIpError(
            f"node name {name!r} does not resolve ({exc}); use ray.node_ip mode interface or prefix "
            "(or loopback-index when every node is this one host)"
        ) from None
    return str(infos[0][4][0])


def interface_ip(interface: str) -> str:
    """The IPv4 address of a local network interface."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, struct.pack("256s", interface.encode()[:15]))
        except OSError:
            raise NodeIpError(
                f"interface {interface!r} has no IPv4 address on {socket.gethostname()} "
                f"(interfaces: {', '.join(local_interfaces())})"
            ) from None
    return socket.inet_ntoa(packed[20:24])


def local_interfaces() -> list[str]:
    return [name for _, name in socket.if_nameindex()]


def local_ipv4s() -> dict[str, str]:
    """Interface name -> IPv4 address for every local interface that has one."""
    found = {}
    for name in local_interfaces():
        try:
            found[name] = interface_ip(name)
        except NodeIpError:
            continue
    return found


def pick_by_prefix(addresses: Sequence[str], prefix: str) -> str:
    """The lowest address starting with `prefix` (deterministic when a node has several)."""
    matches = sorted(
        (a for a in addresses if a.startswith(prefix)), key=lambda a: int(ipaddress.ip_address(a))
    )
    if not matches:
        raise NodeIpError(
            f"no IPv4 address of {socket.gethostname()} starts with {prefix!r} (has: {', '.join(addresses)})"
        )
    return matches[0]


def local_ip(mode: str, interface: str | None = None, prefix: str | None = None) -> str:
    """This node's IP for the interface/prefix/hostname modes."""
    if mode == "interface":
        return interface_ip(interface or "")
    if mode == "prefix":
        return pick_by_prefix(list(local_ipv4s().values()), prefix or "")
    if mode == "hostname":
        return hostname_ip(socket.gethostname())
    raise NodeIpError(f"mode {mode!r} cannot be probed on a node")


def node_ips(
    entries: Sequence[tuple[str, str | None]], mode: str, resolve: Callable[[str], str] = hostname_ip
) -> list[tuple[str, str]]:
    """Give every (name, ip-or-None) entry an IP: given IPs win; otherwise per `mode`."""
    result = []
    for index, (name, ip) in enumerate(entries):
        if ip is None:
            if mode == "loopback-index":
                ip = loopback_ip(index)
            elif mode == "hostname":
                ip = resolve(name)
            else:
                raise NodeIpError(
                    f"node {name}: ip mode {mode!r} needs the IP in the node file ('NAME IP'); the job "
                    "script collects it by probing each node"
                )
        result.append((name, ip))
    return result
