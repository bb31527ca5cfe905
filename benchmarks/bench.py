"""`python -m benchmarks.bench` (`make bench`): `amp_lab bench` with the parts that need this
repository: compile_cache (fill torch.compile's caches for the compiled throughput rows, --jobs
processes at a time), feed (synthetic data against JPEG files decoded on the host and on the
device) and peer (timm's own train.py against amp_lab, whole runs).

  python -m benchmarks.bench --parts compile_cache throughput --compile on --jobs 8   # GPU
  python -m benchmarks.bench --parts peer --peer-script path/to/timm/train.py --models test_vit \\
      --precisions bf16 --data-dir DIR --epochs 3 --rounds 3 --threads 1
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from amp_lab.config import ConfigError
from amp_lab.tools.bench import cli

if TYPE_CHECKING:
    import torch

PARTS = {
    "compile_cache": "benchmarks.compile_cache",
    **cli.PARTS,
    "feed": "benchmarks.feed",
    "peer": "benchmarks.peer",
}


def options(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--peer-script", type=Path, help="peer: timm's train.py, from a checkout of timm")
    add(
        "--data-dir",
        type=Path,
        help="feed, peer: an ImageFolder with train/ and val/ (default: synthetic JPEGs)",
    )
    add("--epochs", type=int, default=3, help="peer: epochs of each run (default 3)")
    add("--workers", type=int, help="feed, peer: loader workers (default: 0 on CPU, 8 on CUDA)")
    add("--jobs", type=int, default=1, help="compile_cache processes at a time (default 1)")


def check(args: argparse.Namespace, device: torch.device) -> None:
    """This device's defaults for the options above; a bad file fails now, not after the other
    parts. peer: --rounds are rounds of (peer, amp_lab)."""
    from benchmarks.peer import check_data_dir, check_peer_script

    if min(args.jobs, args.epochs) < 1:
        raise ConfigError("--jobs and --epochs must be >= 1")
    if args.workers is None:
        args.workers = 8 if device.type == "cuda" else 0
    args.peer_precisions = args.precisions or ["bf16"]  # a mode timm's train.py has
    if "peer" in args.parts:
        args.peer_script = check_peer_script(args.peer_script)
    if args.data_dir is not None and {"feed", "peer"} & set(args.parts):
        args.data_dir = check_data_dir(args.data_dir)


def main(argv: list[str] | None = None) -> int:
    return cli.main(argv, PARTS, "python -m benchmarks.bench", (options, check))


if __name__ == "__main__":
    sys.exit(main())
