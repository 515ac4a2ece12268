"""Joining a Ray cluster, or failing within seconds naming the address.

`ray.init(address="HOST:PORT")` with nothing listening there does not fail: Ray's GCS client logs
"Failed to connect to GCS ... within 5 seconds" and retries, for minutes (a hostile re-test gave up at
120 s). So before Ray is asked, `connect_ray` opens a plain TCP connection to the address (for a
`HOST:PORT` or `ray://HOST:PORT`; "auto" and None are Ray's own lookups and fail fast): refused, or
nothing within `timeout_s`, is a `ClusterUnreachable` naming the address and how to start a cluster.
A port that accepts connections but is no Ray head is still Ray's own (long) wait.

Every `--executor ray` / `--replicas` path joins through here (data prepare and pack, generate, serve).
Knows nothing about what runs on the cluster; Ray is imported only when called.

    ray = connect_ray("127.0.0.1:6379")
"""

from __future__ import annotations

import socket
import time
from typing import Any

CONNECT_TIMEOUT_S = 30.0
RETRY_S = 0.5  # a head that is starting refuses for a moment: retry a refusal for a few seconds
REFUSED_GRACE_S = 3.0


class ClusterUnreachable(ConnectionError):
    """No Ray cluster answers at the given address; the message names it."""


def connect_ray(address: str | None, timeout_s: float = CONNECT_TIMEOUT_S, **init_kwargs: Any) -> Any:
    """The `ray` module, this process joined to the cluster at `address` (None: a new local cluster) unless
    it already is; `ClusterUnreachable` when a HOST:PORT accepts no connection within `timeout_s`."""
    import ray  # deferred: an optional dependency; callers say how to install it

    if ray.is_initialized():
        return ray
    if address and address not in ("auto", "local"):
        check_reachable(address, timeout_s)
    ray.init(address=address, include_dashboard=False, logging_level="WARNING", **init_kwargs)
    return ray


def check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    host, port = _host_port(address)
    deadline = time.monotonic() + timeout_s
    refused_since, why = None, ""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            with socket.create_connection((host, port), timeout=min(left, 5.0)):
                return
        except OSError as e:
            why = e.strerror or type(e).__name__
            if isinstance(e, ConnectionRefusedError):
                refused_since = refused_since or time.monotonic()
                if time.monotonic() - refused_since >= REFUSED_GRACE_S:
                    break
        time.sleep(min(RETRY_S, max(0.0, deadline - time.monotonic())))
    raise ClusterUnreachable(f"no Ray cluster at {address}: {host}:{port} accepts no connection ({why.lower()}); "
                             f"start one there (`ray start --head --port {port}`) or pass the address it prints")


def _host_port(address: str) -> tuple[str, int]:
    rest = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        raise ClusterUnreachable(f"Ray address {address!r}: expected HOST:PORT (or ray://HOST:PORT, or auto)")
    return host.strip("[]") or "127.0.0.1", int(port)
