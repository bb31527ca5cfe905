"""A case of the doctor benchmark: the fixed ones (suite.py's CASES) and drawn ones (draw.py)."""

from __future__ import annotations

from dataclasses import dataclass

# tiny and quick on 2 CPU cores: a one-block ViT on 16 px digits, small batches
SUITE_BASE = [
    "model=test_vit",
    "data.img_size=16",
    "trainer.batch_size=16",
    "+model.kwargs.depth=1",
    "data.val_fraction=0.05",
    "trainer.device=cpu",
]


@dataclass(frozen=True)
class Case:
    """One failure class: the overrides that produce it and the cause the doctor must name."""

    name: str
    overrides: tuple[str, ...]
    cause: str  # the `cause` of the recommendation that must rank first
    base: tuple[str, ...] = tuple(SUITE_BASE)  # the model and data it runs on
    kind: str = ""  # its failure class (draw.py); "": the case's own name
