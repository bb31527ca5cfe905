"""The training/inference mismatch of "fp16 is back" (arXiv 2510.26788), measured on a CPU.

The paper's mismatch is between two engines' forward passes of the same weights. On a CPU this
module stands two computation paths of one built run in for them:
- training: model.train(), the whole batch at once, timm's fused attention
  (F.scaled_dot_product_attention), as the training step computes it;
- inference: model.eval(), the batch in chunks of INFER_BATCH, attention written out
  (q @ k^T, softmax, @ v: timm's `fused_attn = False`), as a separate serving kernel would.
Both under the same autocast; the mismatch is the logits' mean KL(training || inference).

`python -m benchmarks.engine_mismatch <overrides>` prints it for fp16 and bf16.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from amp_lab.run import Run
from amp_lab.tools.numerics.capture import first_batch
from amp_lab.tools.numerics.compare import kl
from amp_lab.tools.numerics.find import built

INFER_BATCH = 8
MODES = ("fp16", "bf16")


@contextmanager
def unfused_attention(model: torch.nn.Module) -> Iterator[None]:
    """timm's attention modules with their explicit (unfused) path, put back after."""
    modules = [m for m in model.modules() if hasattr(m, "fused_attn")]
    before = [m.fused_attn for m in modules]
    for m in modules:
        m.fused_attn = False  # type: ignore[assignment]  # a plain bool attribute of timm's
    try:
        yield
    finally:
        for m, fused in zip(modules, before):
            m.fused_attn = fused


@torch.no_grad()
def paths(run: Run, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of the training path and of the inference path, fp32 copies."""
    model, policy = run.model, run.policy
    model.train()
    with policy.autocast():
        train = model(images).float()
    model.eval()
    with unfused_attention(model), policy.autocast():
        infer = torch.cat([model(chunk).float() for chunk in images.split(INFER_BATCH)])
    model.train()
    return train, infer


def mismatch(overrides: list[str], modes: tuple[str, ...] = MODES) -> dict[str, float]:
    """Per mode: the logit KL between the two paths, on the run's first batch."""
    found = {}
    with tempfile.TemporaryDirectory(prefix="amp_lab_engines_") as work:
        for mode in ("fp32", *modes):  # fp32: the two paths' own difference, without rounding
            with built([*overrides, f"precision={mode}"], Path(work) / mode) as run:
                images, _ = first_batch(run)
                found[mode] = kl(*paths(run, images))
    return found


def main(argv: list[str] | None = None) -> int:
    found = mismatch(sys.argv[1:] if argv is None else argv)
    for mode, value in found.items():
        print(f"{mode}: training vs inference path, logit KL {value:.3e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
