"""Which process serves a backend's address: the one holding the listening socket a connection reaches.

``/proc/net/tcp`` and ``tcp6`` list this network namespace's listening sockets
with their local address, owner and inode; ``/proc/PID/fd`` shows which process
holds an inode (socket inodes are unique, so a holder found that way listens in
this namespace). A connection to HOST:PORT reaches a socket bound to exactly
that address if there is one, else one bound to its family's wildcard
(``0.0.0.0``, ``::``), else, for IPv4, a dual-stack ``::`` one: the kernel's
own order, followed here. So a server on ``127.0.0.2:P`` is never taken for
the backend ``http://127.0.0.1:P``, and ``localhost`` means the loopback
addresses, both of them.

Several processes behind one address (``SO_REUSEPORT``) are one server only
when they are one process tree (workers that inherited its socket); otherwise
the match is ambiguous and refused, the candidates named. Processes whose
``/proc/PID/fd`` cannot be read (another user's, unless we are root) are never
candidates.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from hibernate import procinfo
from hibernate.errors import NoSuchProcessError, PermissionDeniedError, UsageError

LISTEN = "0A"  # the TCP state column of /proc/net/tcp for a listening socket
TABLES = ("/proc/net/tcp", "/proc/net/tcp6")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
LOOPBACK: tuple[IPAddress, ...] = (ipaddress.IPv4Address("127.0.0.1"), ipaddress.IPv6Address("::1"))
WILDCARD: dict[int, IPAddress] = {4: ipaddress.IPv4Address("0.0.0.0"), 6: ipaddress.IPv6Address("::")}


@dataclass(frozen=True)
class Listener:
    """One listening socket of ``/proc/net/tcp[6]``."""

    address: IPAddress
    port: int
    uid: int
    inode: int

    def __str__(self) -> str:
        host = f"[{self.address}]" if self.address.version == 6 else str(self.address)
        return f"{host}:{self.port}"


@dataclass(frozen=True)
class Server:
    """The process found serving an address: the topmost holder of the socket(s) it reaches."""

    pid: int
    uid: int | None
    listener: Listener
    command: str

    def describe(self) -> str:
        return f"pid {self.pid} on {self.listener} ({self.command or '?'})"


# -- pure: the tables and the kernel's choice ------------------------------------------------------


def parse_address(hex_address: str, byteorder: Literal["little", "big"] = sys.byteorder) -> IPAddress:
    """An address as ``/proc/net/tcp[6]`` prints it: 32-bit words in host byte order, each as %08X.

    An IPv4-mapped IPv6 address (``::ffff:a.b.c.d``) is the IPv4 address it maps.
    """
    if len(hex_address) not in (8, 32):
        raise ValueError(f"not an address of /proc/net/tcp: {hex_address!r}")
    raw = b"".join(
        int(hex_address[i : i + 8], 16).to_bytes(4, byteorder) for i in range(0, len(hex_address), 8)
    )
    address = ipaddress.ip_address(raw)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def listeners(table: str, byteorder: Literal["little", "big"] = sys.byteorder) -> list[Listener]:
    """The listening sockets of a ``/proc/net/tcp``-format ``table``."""
    found = []
    for line in table.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10 or fields[3] != LISTEN:
            continue
        hex_address, _, hex_port = fields[1].rpartition(":")
        try:
            address = parse_address(hex_address, byteorder)
        except ValueError:
            continue
        found.append(Listener(address, int(hex_port, 16), int(fields[7]), int(fields[9])))
    return found


def reached(sockets: Iterable[Listener], address: IPAddress, port: int) -> list[Listener]:
    """The listening sockets a connection to ``address:port`` may reach, in the kernel's order: those
    bound to the address itself, else to its family's wildcard, else (IPv4) to the dual-stack ``::``."""
    on_port = [s for s in sockets if s.port == port]
    tiers: list[IPAddress] = [address, WILDCARD[address.version]]
    if address.version == 4:
        tiers.append(WILDCARD[6])
    for bound in tiers:
        matching = [s for s in on_port if s.address == bound]
        if matching:
            return matching
    return []


def host_addresses(host: str, resolve: Callable[[str], Sequence[str]] | None = None) -> list[IPAddress]:
    """The addresses a backend URL's host names: an address as written (an IPv4-mapped one as IPv4),
    ``localhost`` as the loopback addresses, a name as the resolver says."""
    if host.lower() == "localhost":
        return list(LOOPBACK)
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        names = (resolve or _resolve)(host)
        return list(dict.fromkeys(a for name in names for a in host_addresses(name)))
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return [address.ipv4_mapped]
    return [address]


def roots(pids: Iterable[int], parent_of: Callable[[int], int | None]) -> list[int]:
    """Those of ``pids`` none of whose ancestors is another of them, lowest first: the servers, not
    the children that inherited a server's socket."""
    return procinfo.topmost(sorted(set(pids)), parent_of)


# -- this machine ----------------------------------------------------------------------------


def _resolve(host: str) -> list[str]:
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise NoSuchProcessError(f"cannot resolve the backend host {host!r}: {exc}") from None
    return [str(info[4][0]) for info in infos]


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def holders(inodes: Mapping[int, Listener], pids: Iterable[int]) -> dict[int, Listener]:
    """Those of ``pids`` that hold one of the socket ``inodes``, with the socket (processes that
    cannot be read are skipped)."""
    wanted = {f"socket:[{inode}]": listener for inode, listener in inodes.items()}
    found: dict[int, Listener] = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                listener = wanted.get(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                continue
            if listener is not None:
                found[pid] = listener
                break
    return found


def server_at(host: str, port: int) -> Server | None:
    """The process serving ``host:port`` on this machine, if one we can see listens there.

    Refused (UsageError) when several unrelated processes could answer there,
    and (PermissionDeniedError) when the socket is another user's and we
    cannot look into its process.
    """
    sockets = [s for table in TABLES for s in listeners(_read(table))]
    reach = {s.inode: s for address in host_addresses(host) for s in reached(sockets, address, port)}
    if not reach:
        return None
    held = holders(reach, (int(name) for name in os.listdir("/proc") if name.isdigit()))
    if not held:
        owners = ", ".join(sorted({procinfo.describe_user(s.uid) for s in reach.values()}))
        where = ", ".join(sorted({str(s) for s in reach.values()}))
        raise PermissionDeniedError(
            f"{where} is served by a process of {owners}, not one of yours",
            hint="run hibernate serve as that user",
        )
    servers = [
        Server(pid, procinfo.owner_uid(pid), held[pid], procinfo.command_line(pid)[:80])
        for pid in roots(held, procinfo.parent_pid)
    ]
    if len(servers) > 1:
        raise UsageError(
            f"{host}:{port} is served by {len(servers)} unrelated processes: "
            + "; ".join(s.describe() for s in servers),
            hint="give the backend's pid in serve.toml ([[backend]] pid = ...)",
        )
    return servers[0] if servers else None
