"""The one way a tool makes a run of its own (the only tool module that builds or trains, as
tests/test_layers.py checks): settings, the run built, trained, or read at its first step."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from amp_lab.compose import compose_settings
from amp_lab.config import AmpLabConfig

if TYPE_CHECKING:  # torch and timm load only when a run is built
    from amp_lab.run import Run
    from amp_lab.step import Batch
    from amp_lab.tracking.sinks import Sink

# a probe keeps nothing of a user's run: `logger.mode`, not the `logger=` group, since a key
# override beats a group choice whatever their order
QUIET = [
    "logger.mode=disabled",
    "checkpoint.enabled=false",
    "trainer.progress=false",
    "trainer.resume=false",
]


def settings(overrides: Sequence[str], *own: str, quiet: bool = True) -> AmpLabConfig:
    """The validated settings of a tool's run: the user's overrides, QUIET (unless the tool
    measures a user's run as it is), then the tool's own, which win (ConfigError when bad)."""
    return compose_settings([*overrides, *(QUIET if quiet else []), *own])


def build_run(settings: AmpLabConfig, out: Path) -> Run:
    """The run of `settings` in `out`, built and not started."""
    from amp_lab.build import build

    return build(settings, out)


@contextmanager
def built(settings: AmpLabConfig, out: Path) -> Iterator[Run]:
    """The run of `settings`, its process group closed after use (for a run not trained)."""
    run = build_run(settings, out)
    try:
        yield run
    finally:
        run.dist.close()


def train(run: Run, sinks: Sequence[Sink] = ()) -> dict[str, Any]:
    """Train a built run to its end (`sinks`: more sinks after the run's own); its summary."""
    from amp_lab.trainer import Trainer

    return Trainer(run, list(sinks)).fit()


def fit(settings: AmpLabConfig, out: Path, sinks: Sequence[Sink] = ()) -> dict[str, Any]:
    """Build and train the run of `settings` in `out`; its summary."""
    return train(build_run(settings, out), sinks)


def first_micro_batches(run: Run, mixed: bool = True) -> list[Batch]:
    """The micro-batches of the run's first optimizer step, mixed up unless `mixed` is false."""
    from amp_lab.components.augment import mix_batches
    from amp_lab.step import take

    run.sampler.set_epoch(0, 0)
    batches = take(run.data.train_batches(run.sampler), run.settings.trainer.grad_accum)
    return mix_batches(run.mixup, batches) if mixed else batches
