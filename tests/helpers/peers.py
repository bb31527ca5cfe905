"""The bench's file-reading parts (feed, peer) on a tiny ViT, and a stand-in for timm's
train.py: CI has no timm checkout, and its script is never copied here.

It takes train.py's arguments, records them (and when it started) in $FAKE_PEER_RECORD, prints
timm's per-update `Train:` lines with known rates, or fails as told by $FAKE_PEER_FAIL.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

# the feed and peer parts on a tiny ViT: 4 batches of 8 16-px images per epoch, one CPU thread
FILE_BENCH = [
    "--models",
    "test_vit",
    "--img-size",
    "16",
    "--batch-size",
    "8",
    "--steps",
    "4",
    "--device",
    "cpu",
    "--threads",
    "1",
]
# per epoch, 4 updates: the first slow (warm-up), then 100, 200 and 100 samples/s
FAKE_RATES = [1.0, 100.0, 200.0, 100.0]
FAKE_PEER = textwrap.dedent(
    f"""
    import json, os, sys, time
    args = sys.argv[1:]
    with open(os.environ["FAKE_PEER_RECORD"], "a") as record:
        record.write(json.dumps({{"argv": args, "time": time.time()}}) + "\\n")
    if os.environ.get("FAKE_PEER_FAIL"):
        sys.exit("RuntimeError: out of patience")
    for epoch in range(int(args[args.index("--epochs") + 1])):
        for i, rate in enumerate({FAKE_RATES}):
            print(f"Train: {{epoch}} [{{i:>4d}}/4 ({{25 * (i + 1):>3d}}%)]  Loss: 2.30 (2.30)  "
                  f"Time: {{8 / rate:.3f}}s, {{rate:>7.2f}}/s  ({{8 / rate:.3f}}s, "
                  f"{{rate:>7.2f}}/s)  LR: 1.000e-03  Data: 0.010 (0.010)", file=sys.stderr)
    """
)


def write_fake_peer(folder: Path) -> Path:
    """train.py in `folder`; set $FAKE_PEER_RECORD before running it."""
    script = folder / "train.py"
    script.write_text(FAKE_PEER)
    return script
