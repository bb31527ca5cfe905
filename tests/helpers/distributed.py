"""Launch amp_lab on two gloo ranks, as a user does with torchrun."""

from __future__ import annotations

import socket
import sys


def free_port() -> int:
    """A loopback port nothing listens on now, for a rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun_amp_lab(*overrides: str, ranks: int = 2) -> list[str]:
    """`torchrun --nproc_per_node=RANKS -m amp_lab OVERRIDES` with a fresh rendezvous port."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={ranks}",
        f"--master_port={free_port()}",
        "-m",
        "amp_lab",
        *overrides,
    ]
