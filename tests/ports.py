"""TCP ports for the tests' rendezvous (``MASTER_PORT``, ``torchrun --master_port``) and local
Slurm daemons: below the kernel's ephemeral range, one slice per pytest-xdist worker, handed
out in turn.

``tst_megatron.runtime.distributed.free_port`` asks the kernel for port 0, i.e. a port of the
ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``), which the kernel also gives to
every outgoing connection: gloo's meshes, TCPStore clients and Slurm's RPCs of the other
worker may take it before the test's process binds it (``EADDRINUSE`` in
``init_process_group``), e.g. between the runs of a test that launches three times on one
port. Here no connection is given these ports, and no two tests in one session get the same
one (until a slice of several thousand wraps round).
"""

from __future__ import annotations

import os
import socket

from tst_megatron.runtime.distributed import free_port as kernel_pick

#: The first port: above the ports the Slurm template derives for its tests' jobs
#: (``tst_megatron.runtime.slurm``: 10000 + job id).
FIRST = 20000


def _ephemeral_low() -> int:
    """The kernel's first ephemeral port (Linux's default 32768 when it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def worker_ports(environ=os.environ, ephemeral_low: int | None = None) -> range:
    """This process's slice of ``[FIRST, ephemeral_low)``: slice ``i`` of
    ``PYTEST_XDIST_WORKER_COUNT`` for worker ``gw<i>`` (pytest-xdist sets both; without them,
    the whole range)."""
    high = _ephemeral_low() if ephemeral_low is None else ephemeral_low
    count = int(environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    worker = environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[:2] == "gw" and worker[2:].isdigit() else 0
    span = (high - FIRST) // max(count, 1)
    if span < 100:  # a machine with a low ephemeral range: take the kernel's pick
        return range(0)
    start = FIRST + (index % max(count, 1)) * span
    return range(start, start + span)


_PORTS = worker_ports()
_turn = 0


def _bindable(port: int) -> bool:
    """Nothing holds ``port`` on any address now (no ``SO_REUSEADDR``: a port still in
    TIME_WAIT counts as held)."""
    with socket.socket() as sock:
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """The next port of this worker's slice that nothing holds; the kernel's pick (port 0)
    when the slice is empty or all held. Raises nothing."""
    global _turn
    for _ in range(len(_PORTS)):
        port = _PORTS[_turn % len(_PORTS)]
        _turn += 1
        if _bindable(port):
            return port
    return kernel_pick()
