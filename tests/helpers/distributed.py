"""Launch amp_lab on two gloo ranks, as a user does with torchrun."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from helpers.compose import ROOT


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


def torchrun(*overrides: str, cwd: Path, ranks: int = 2) -> subprocess.CompletedProcess[str]:
    """Run `torchrun_amp_lab(OVERRIDES)` in `cwd` with this checkout's package, one thread."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        torchrun_amp_lab(*overrides, ranks=ranks),
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def as_rank(rank: int, port: int, world_size: int = 2) -> None:
    """This process (an mp.spawn worker) as `rank` of a local world, in torchrun's variables."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
