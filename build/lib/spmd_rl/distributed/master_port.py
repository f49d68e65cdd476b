"""Rank 0 holds torchrun's ``MASTER_PORT`` from its first statement until the process group
binds it.

torchrun's agent picks ``MASTER_PORT`` as a free ephemeral port (bind to port 0, close), and
rank 0's TCPStore binds it only after the rank has imported torch and vLLM, seconds later (the
agent's own store is not shared with the workers: ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``, see
``launcher/local.py``). Any ``bind(0)`` or outgoing connection on the host in between may be
given that port; rank 0 then fails with EADDRINUSE and torchrun restarts the group (seen with
two jobs on one host). An explicit bind reserves a port: the kernel hands it neither to
``bind(0)`` nor to a connection's automatic bind, and without SO_REUSEADDR no other bind may
share it. So rank 0 binds it at once (never listening: closing leaves no TIME_WAIT) and closes
it just before ``init_process_group`` binds it, which shrinks the window from the imports to
microseconds.

Invariant: only the process with ``RANK=0`` holds anything, and a port it cannot bind (taken
already) is left for ``init_process_group`` to report."""

from __future__ import annotations

import os
import socket


def hold_master_port() -> socket.socket | None:
    """The bound socket holding ``MASTER_PORT`` in rank 0 of a torchrun group, else None."""
    if os.environ.get("RANK") != "0" or not os.environ.get("MASTER_PORT", "").isdigit():
        return None
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # no SO_REUSEADDR: no other bind may share it
    try:
        sock.bind(("", int(os.environ["MASTER_PORT"])))
    except OSError:
        sock.close()
        return None
    return sock


def release_master_port(held: socket.socket | None) -> None:
    """Free the port for the TCPStore about to bind it (a no-op where nothing is held)."""
    if held is not None:
        held.close()
