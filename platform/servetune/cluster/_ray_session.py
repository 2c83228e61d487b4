"""The local Ray a driver starts: recorded in the runs dir, and its leftovers stopped by the next start.

A driver that runs its own local Ray (``ray.init()`` without an address) owns a GCS server, a
raylet, agents and workers. A SIGKILLed driver cannot stop them, and some (the dashboard and
runtime-env agents, idle workers) outlive it. So when the driver starts its own local Ray it
writes ``<runs_dir>/ray/<study>.json`` (the session dir, the GCS address, its own pid and start
time, the node processes' pids and start times), and the next start of the same study
(``--resume``) stops what is left of that session:

- nothing is touched while the recorded driver still runs (same pid, same start time);
- a process is that session's when it is one of the recorded pids (same start time, so a reused
  pid is never hit) or when its command line or an open file points into the recorded session
  dir (Ray's workers and agents write their logs there);
- a Ray the driver joined (``RAY_ADDRESS``, a cluster) is never recorded, so never stopped.

Linux ``/proc`` only; elsewhere there is nothing to reap and nothing is recorded.

:func:`start_local_ray` starts that local Ray on loopback only: its node address is 127.0.0.1, so the
GCS server, the raylet, the dashboard and runtime-env agents, the workers and the driver's own core
worker listen on 127.0.0.1 and nowhere else, and Ray's dashboard is off unless
``SERVETUNE_RAY_DASHBOARD=1`` asks for it (then on 127.0.0.1 too). A cluster the driver joins is the
user's Ray, configured by its own ``ray start``.

Example::

    reaped = reap_leftovers(runs_dir, "my-study")      # before starting Ray
    ...ray.init()...
    record_local_session(runs_dir, "my-study")          # right after starting it
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from servetune import envs
from servetune.errors import SpecError

__all__ = ["record_path", "record_local_session", "session_processes", "reap_leftovers", "start_local_ray",
           "join_cluster", "recorded_cluster", "cluster_endpoint", "wait_for_cluster", "join_failure", "LOOPBACK",
           "RAYLET_LATE", "LOCAL_RAY_ATTEMPTS", "JOIN_GCS_ATTEMPTS"]

_PROC = Path("/proc")
#: The one address a local Ray of servetune's binds to.
LOOPBACK = "127.0.0.1"


def start_local_ray(**init_kwargs: Any) -> None:
    """``ray.init(**init_kwargs)`` of a new local Ray bound to 127.0.0.1 only (see the module docstring).

    Ray's components listen on loopback only when the node address is literally ``127.0.0.1`` (the
    GCS server, raylet and core workers compare it; the agents test ``is_localhost``). But Ray 2.60's
    ``ray.init`` rewrites a loopback ``_node_ip_address`` to the host's routable address
    (``services.resolve_ip_for_localhost`` -> ``get_node_ip_address``), unless Ray clusters are
    disabled (``ray_constants.ENABLE_RAY_CLUSTER``, False on macOS and Windows, where Ray keeps its
    node on loopback). That switch is turned off for the duration of this ``ray.init`` only; once the
    node exists, every address lookup reads the node's own. A node that still came up elsewhere
    is shut down and refused: a study never runs on a Ray that listens beyond loopback.

    Always a new one (``address="local"``): without it, Ray's ``ray.init`` joins the cluster that the last
    ``ray start`` on this machine recorded (``<Ray's temp dir>/ray_current_cluster``) and, asked for GPUs and
    CPUs, refuses with a traceback. :func:`recorded_cluster` says which that is, for the caller to report.

    Where Ray gives the new node's raylet up (:data:`RAYLET_LATE`, on a loaded machine), the processes that
    attempt started are ended and the node is started again, :data:`LOCAL_RAY_ATTEMPTS` times in all.
    """
    from unittest import mock  # the standard library's scoped attribute patch, restored on exit

    import ray
    from ray._private import ray_constants

    dashboard = os.environ.get("SERVETUNE_RAY_DASHBOARD", "").strip().lower() in ("1", "true", "yes", "on")
    init_kwargs.update(address="local", _node_ip_address=LOOPBACK, include_dashboard=dashboard, dashboard_host=LOOPBACK)
    for attempt in range(1, LOCAL_RAY_ATTEMPTS + 1):
        before = _descendants(os.getpid())
        try:
            with mock.patch.object(ray_constants, "ENABLE_RAY_CLUSTER", False):
                ray.init(**init_kwargs)
            break
        except Exception as exc:  # noqa: BLE001 - Ray raises a bare Exception for a late raylet
            if attempt == LOCAL_RAY_ATTEMPTS or RAYLET_LATE not in str(exc):
                raise
            # The half-started node (its GCS, raylet and reaper) is this process's; end it, then start anew.
            _kill_all({pid for pid in _descendants(os.getpid()) - before if _is_ray_process(pid)})
    node = getattr(ray._private.worker, "_global_node", None)
    address = getattr(node, "node_ip_address", None)
    if address != LOOPBACK:
        ray.shutdown()
        raise RuntimeError(f"the local Ray came up on {address!r}, not {LOOPBACK}: refusing to run a study on it")


#: How many times a driver joining a cluster asks its GCS for the cluster id, each up to Ray's own ~35 s
#: wait (``RAY_gcs_server_port_wait_time_s``, read by ``Node._init_gcs_client`` in Ray 2.60: its default of
#: 20 tries held a driver at an address that accepts connections but never answers as a GCS for minutes; one
#: try gave up in 46 s, 2026-12-06).
JOIN_GCS_ATTEMPTS = 1


def join_cluster(address: str, **init_kwargs: Any) -> None:
    """``ray.init(address=address, **init_kwargs)`` of a driver joining a cluster, said in one line where it
    cannot: a :class:`~servetune.errors.SpecError` on ``RAY_ADDRESS`` when nothing answers at the address
    within ``SERVETUNE_RAY_CONNECT_WAIT_S`` (:func:`wait_for_cluster`), or when Ray refuses the join
    (:func:`join_failure` says why), after at most :data:`JOIN_GCS_ATTEMPTS` of Ray's GCS tries."""
    import ray

    wait_s = envs.ray_connect_wait_s()
    if not wait_for_cluster(address, wait_s):
        raise SpecError("RAY_ADDRESS", f"no Ray cluster answers at {address} (waited {wait_s:.0f} s)",
                        "start the cluster's head there (`ray start --head`), or unset RAY_ADDRESS "
                        "to run the study on a local Ray")
    try:
        with _join_attempts_bounded():
            ray.init(address=address, **init_kwargs)
    except ConnectionError as exc:  # e.g. a cluster with token authentication and no token here
        raise SpecError("RAY_ADDRESS", f"cannot join the Ray cluster at {address} ({join_failure(exc)})",
                        "check the address (`ray status` on the head prints it) and, on a cluster "
                        "with token authentication, give this machine its token (RAY_AUTH_TOKEN or "
                        "~/.ray/auth_token)") from exc


@contextlib.contextmanager
def _join_attempts_bounded() -> Iterator[None]:
    """Ray's GCS tries of a joining driver bounded to :data:`JOIN_GCS_ATTEMPTS` for the ``ray.init``
    inside, unless the user set ``RAY_gcs_server_port_wait_time_s``; the environment as it was after."""
    if "RAY_gcs_server_port_wait_time_s" in os.environ:
        yield
        return
    os.environ["RAY_gcs_server_port_wait_time_s"] = str(JOIN_GCS_ATTEMPTS)
    try:
        yield
    finally:
        os.environ.pop("RAY_gcs_server_port_wait_time_s", None)


#: What Ray 2.60 raises when a node's raylet did not register with its GCS within 30 s
#: (``raylet_start_wait_time_s`` in ``ray/_private/node.py``: a constant, no setting); seen on 2 loaded cores.
RAYLET_LATE = "The current node timed out during startup"
#: How many times :func:`start_local_ray` starts the local Ray where Ray gave its raylet up (:data:`RAYLET_LATE`).
LOCAL_RAY_ATTEMPTS = 2


def _descendants(pid: int) -> set[int]:
    """The live processes ``pid`` started, and theirs (``/proc``'s parent links; empty elsewhere)."""
    parents: dict[int, int] = {}
    if _PROC.is_dir():
        for entry in _PROC.iterdir():
            if entry.name.isdigit():
                with contextlib.suppress(OSError, IndexError, ValueError):
                    parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier and child not in found}
        found |= frontier
    return found


def _is_ray_process(pid: int) -> bool:
    """A process of Ray's own (its command line names ray: gcs_server, raylet, Ray's reaper and agents)."""
    try:
        return b"ray" in (_PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return False


def _kill_all(pids: set[int]) -> None:
    """SIGKILL ``pids`` and reap those that are this process's children."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, 0)


def recorded_cluster() -> str | None:
    """The address of the Ray cluster the last ``ray start`` on this machine recorded (Ray's own lookup,
    ``services.find_bootstrap_address``: ``ray_current_cluster`` in Ray's temp dir, ``RAY_TMPDIR`` moves
    it), which ``ray stop`` removes; None where there is none. A bare ``ray.init()`` would join it."""
    from ray._private import services

    try:
        address = services.find_bootstrap_address(None)
    except Exception:  # noqa: BLE001 - a private API; an unreadable record is no record
        return None
    return str(address) if address else None


def cluster_endpoint(address: str) -> tuple[str, int] | None:
    """The host and port ``ray.init(address=...)`` first connects to: the GCS of ``host:port``, Ray
    Client's server of ``ray://host:port``; None for Ray's own words (``auto``, ``local``) and other
    schemes, which Ray resolves itself.

    >>> cluster_endpoint("10.0.0.5:6379"), cluster_endpoint("ray://head:10001"), cluster_endpoint("[::1]:6379")
    (('10.0.0.5', 6379), ('head', 10001), ('::1', 6379))
    >>> cluster_endpoint("auto"), cluster_endpoint("anyscale://x"), cluster_endpoint("head:port")
    (None, None, None)
    """
    rest = address.strip()
    if rest.startswith("ray://"):
        rest = rest[len("ray://"):]
    elif "://" in rest:
        return None
    host, sep, port = rest.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    return host, int(port)


def wait_for_cluster(address: str, wait_s: float) -> bool:
    """True once something accepts a TCP connection at :func:`cluster_endpoint` of ``address``, tried about
    once a second for ``wait_s`` seconds; True at once where the address names no endpoint (Ray resolves
    it, or refuses it at once). ``auto`` is the cluster Ray's own lookup finds (:func:`_auto_address`).
    :func:`join_cluster` calls it before ``ray.init(address=...)``, which retries an absent cluster without end."""
    if address.strip() == "auto":
        address = _auto_address()
    endpoint = cluster_endpoint(address)
    if endpoint is None:
        return True
    deadline = time.monotonic() + max(0.0, wait_s)
    while True:
        try:
            with socket.create_connection(endpoint, timeout=2.0):
                return True
        except OSError:
            pass
        if time.monotonic() >= deadline:
            return False
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


def join_failure(exc: BaseException) -> str:
    """Why ``ray.init(address=...)`` could not join, in a few words from the exception and its causes (Ray's
    own messages carry gRPC tracebacks): an authentication refusal by name, else the first line up to any
    traceback.

    >>> join_failure(ConnectionError("Failed to connect to GCS. Last connection error: x on error: Traceback (most "
    ...                              "recent call last):\\n  ...\\nRpcError: InvalidAuthToken: token is missing"))
    "the cluster refused this machine's authentication token"
    >>> join_failure(ConnectionError("Could not find any running Ray instance. Please specify one."))
    'Could not find any running Ray instance. Please specify one.'
    """
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in chain and len(chain) < 8:
        chain.append(current)
        current = current.__cause__ or current.__context__
    text = "\n".join(str(e) for e in chain)
    if "InvalidAuthToken" in text or "Unauthenticated" in text:
        return "the cluster refused this machine's authentication token"
    first = (text.strip().splitlines() or [type(exc).__name__])[0]
    for marker in (" on error:", "Traceback"):
        first = first.split(marker, 1)[0]
    return first.strip()[:300] or type(exc).__name__


def _auto_address() -> str:
    """What Ray 2.60 joins for ``address="auto"`` (``services.get_ray_address_from_environment``: the cluster
    ``ray start`` recorded, else any GCS server running on this machine); "" where it finds none (Ray then
    refuses at once with a ConnectionError)."""
    from ray._private import services

    try:
        return str(services.get_ray_address_from_environment("auto", None) or "")
    except Exception:  # noqa: BLE001 - a private API; nothing found is no address
        return ""


def record_path(runs_dir: str | os.PathLike[str], study: str) -> Path:
    return Path(runs_dir) / "ray" / f"{study}.json"


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22), None if gone."""
    try:
        fields = (_PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[19])


def record_local_session(runs_dir: str | os.PathLike[str], study: str) -> Path | None:
    """Write the record of the local Ray this process just started (see the module docstring)."""
    import ray  # deferred: reaping leftovers (the rest of this module) must not import Ray

    node = getattr(ray._private.worker, "_global_node", None)  # the node this driver started
    if node is None or not _PROC.is_dir():
        return None
    pids = [{"pid": info.process.pid, "start": _start_time(info.process.pid), "type": kind}
            for kind, infos in node.all_processes.items() for info in infos if info.process is not None]
    data: dict[str, Any] = {"session_dir": str(Path(node.get_session_dir_path()).resolve()),
                            "gcs_address": node.gcs_address, "driver_pid": os.getpid(),
                            "driver_start": _start_time(os.getpid()), "processes": pids}
    path = record_path(runs_dir, study)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)
    return path


def _points_into(pid: int, session_dir: str) -> bool:
    """The process's command line or one of its open files refers to ``session_dir``."""
    base = _PROC / str(pid)
    try:
        cmdline = (base / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    if "ray" not in cmdline:  # Ray's own processes only (ray::IDLE, raylet, gcs_server, agents), never a reader
        return False
    if session_dir in cmdline:
        return True
    try:
        fds = list((base / "fd").iterdir())
    except OSError:
        return False
    for fd in fds:
        with contextlib.suppress(OSError):
            if os.readlink(fd).startswith(session_dir + os.sep):
                return True
    return False


def session_processes(record: dict[str, Any]) -> list[int]:
    """Live processes of the recorded session (never this process)."""
    if not _PROC.is_dir():
        return []
    session_dir = str(record.get("session_dir") or "")
    recorded = {int(p["pid"]): p.get("start") for p in record.get("processes", [])}
    me = os.getpid()
    out = []
    for entry in _PROC.iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        pid = int(entry.name)
        if pid in recorded and recorded[pid] is not None and _start_time(pid) == recorded[pid]:
            out.append(pid)
        elif session_dir and _points_into(pid, session_dir):
            out.append(pid)
    return sorted(out)


def _driver_alive(record: dict[str, Any]) -> bool:
    """True while the recorded driver runs, this very process included: a study run again in the
    same process (resumed after a Ctrl-C, or a test) still uses the local Ray it started."""
    pid, start = record.get("driver_pid"), record.get("driver_start")
    return pid is not None and start is not None and _start_time(int(pid)) == start


def reap_leftovers(runs_dir: str | os.PathLike[str], study: str, grace_s: float = 5.0) -> list[int]:
    """Stop what is left of the local Ray an earlier driver of ``study`` started; returns the pids.

    SIGTERM, then SIGKILL after ``grace_s`` for what remains. Does nothing when there is no record
    or its driver still runs. The record is removed once its session is gone.
    """
    path = record_path(runs_dir, study)
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    if _driver_alive(record):
        return []
    pids = session_processes(record)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(_start_time(p) is not None and not _zombie(p) for p in pids):
        time.sleep(0.1)
    for pid in pids:
        if _start_time(pid) is not None and not _zombie(pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
    if not session_processes(record):
        with contextlib.suppress(OSError):
            path.unlink()
    return pids


def _zombie(pid: int) -> bool:
    try:
        return (_PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False
