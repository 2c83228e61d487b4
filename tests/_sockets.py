"""The listening TCP sockets of a set of processes, read from ``/proc`` as ``ss -ltnp`` reads them.

``/proc/<pid>/net/tcp`` and ``tcp6`` list every socket of the network namespace with its state and
inode; ``/proc/<pid>/fd`` links name the socket inodes a process holds. A socket in state LISTEN
(``0A``) held by one of the processes is one of theirs. Linux only.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

_PROC = Path("/proc")
_LISTEN = "0A"


def _address(hex_ip: str) -> str:
    """``/proc/net/tcp{,6}``'s address (32-bit words in host byte order, little-endian here) as text."""
    raw = bytes.fromhex(hex_ip)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def _listening(pid: int) -> dict[int, tuple[str, int]]:
    """inode -> (address, port) of the LISTEN sockets in ``pid``'s network namespace."""
    out: dict[int, tuple[str, int]] = {}
    for name in ("tcp", "tcp6"):
        try:
            lines = (_PROC / str(pid) / "net" / name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != _LISTEN:
                continue
            ip, port = fields[1].split(":")
            out[int(fields[9])] = (_address(ip), int(port, 16))
    return out


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        fds = list((_PROC / str(pid) / "fd").iterdir())
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:["):-1]))
    return inodes


def _comm(pid: int) -> str:
    try:
        return (_PROC / str(pid) / "comm").read_text().strip()
    except OSError:
        return "?"


def listening_sockets(pids: set[int] | list[int]) -> list[tuple[int, str, str, int]]:
    """``(pid, command, address, port)`` of each listening TCP socket the processes hold."""
    found = []
    for pid in sorted(set(pids)):
        table = _listening(pid)
        for inode in sorted(_socket_inodes(pid)):
            if inode in table:
                found.append((pid, _comm(pid), *table[inode]))
    return found


def is_loopback(address: str) -> bool:
    """127.0.0.0/8 or ::1 (and ::ffff:127.x); ``0.0.0.0`` / ``::`` (all interfaces) are not."""
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def process_tree(root: int) -> set[int]:
    """``root`` and every live descendant (by parent pid)."""
    children: dict[int, list[int]] = {}
    for entry in _PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in tree:
            tree.add(pid)
            todo += children.get(pid, [])
    return tree
