"""Drawn doctor cases: variations of every failure class that the fixed suite (suite.py) does not
contain, so its figures measure the doctor on cases it was not written against.

`python -m amp_lab.doctor --suite --draw N --seed S` draws N cases, the classes in turn (every
class appears once per round), each with a model among the test ViT, the test ConvNeXt and
resnet18 at 32 px, a module, a fault magnitude, an optimizer (SGD, AdamW), a batch size and an
accumulation from the seeded generator; the same seed draws the same cases.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from amp_lab.config import ConfigError
from amp_lab.doctor.cases import Case
from amp_lab.doctor.probes import key

# per model: its overrides (CPU sizes) and the modules a forward overflow is injected into
MODELS: dict[str, tuple[tuple[str, ...], Callable[[random.Random], str]]] = {
    "test_vit": (
        ("model=test_vit", "data.img_size=16", "+model.kwargs.depth=2"),
        lambda r: f"blocks.{r.randrange(2)}.{r.choice(['mlp.fc1', 'mlp.fc2', 'attn.proj'])}",
    ),
    "test_convnext": (
        ("model=test_convnext", "data.img_size=32"),
        lambda r: f"stages.{r.randrange(3)}.blocks.0.mlp.{r.choice(['fc1', 'fc2'])}",
    ),
    "resnet18": (
        ("model=resnet18", "data.img_size=32"),
        lambda r: f"layer{r.randrange(1, 5)}.{r.randrange(2)}.conv{r.choice([1, 2])}",
    ),
}
# resnet18 is drawn half as often as each test model: CPU fp16 convolutions are slow
MODEL_WEIGHTS = (2, 2, 1)
FP16 = "precision=fp16"


def _underflow(r: random.Random, model: str) -> tuple[list[str], str]:
    # the loss (and with it every gradient) shrunk until fp16 flushes most gradients; AdamW,
    # whose update does not depend on the gradient's size: under SGD fp32 stops training too
    multiplier = r.choice([1e-5, 1e-6, 1e-7])
    return ["precision=fp16_noscale", "optim=adamw", f"fault.loss_multiplier={multiplier}"], (
        "underflow_no_scaler"
    )


def _overflow(r: random.Random, model: str) -> tuple[list[str], str]:
    module = MODELS[model][1](r)
    factor = r.choice([1e7, 1e8, 1e9])  # each passes fp16's 65504 from activations of ~1e-2
    return [FP16, f"fault.overflow_module={module}", f"fault.overflow_factor={factor:g}"], (
        "forward_overflow"
    )


def _lr_too_high(r: random.Random, model: str) -> tuple[list[str], str]:
    return [FP16, f"lr.base={r.choice([2, 5, 10])}"], "baseline"


def _init_scale(r: random.Random, model: str) -> tuple[list[str], str]:
    return [FP16, f"scaler.init_scale={r.choice([1e12, 1e15, 1e18]):g}"], "init_scale_high"


def _eager_growth(r: random.Random, model: str) -> tuple[list[str], str]:
    return [
        FP16,
        "scaler.growth_interval=1",
        f"scaler.growth_factor={r.choice([4, 8, 16])}",
    ], "eager_growth"


def _clip(r: random.Random, model: str) -> tuple[list[str], str]:
    clip = r.choice([0.5, 1.0, 5.0])
    return [FP16, "pitfall=clip_before_unscale", f"trainer.clip_grad={clip}"], (
        "clip_before_unscale"
    )


def _no_update(r: random.Random, model: str) -> tuple[list[str], str]:
    return [FP16, "pitfall=no_scaler_update"], "no_scaler_update"


def _per_micro_batch(r: random.Random, model: str) -> tuple[list[str], str]:
    # the mistake needs accumulation: with one micro-batch per step it is the correct step
    return [FP16, "pitfall=update_every_microbatch", f"trainer.grad_accum={r.choice([2, 3])}"], (
        "update_every_microbatch"
    )


def _half_model(r: random.Random, model: str) -> tuple[list[str], str]:
    return [FP16, "pitfall=half_model"], "half_model"


def _loss_low(r: random.Random, model: str) -> tuple[list[str], str]:
    return [FP16, "pitfall=loss_in_low_precision"], "loss_in_low_precision"


def _healthy(r: random.Random, model: str) -> tuple[list[str], str]:
    return [f"precision={r.choice(['fp32', 'fp16', 'bf16'])}"], "none"


def _transient(r: random.Random, model: str) -> tuple[list[str], str]:
    return [FP16, f"fault.inf_grad_at_step={r.randrange(2, 9)}"], "transient"


CLASSES: dict[str, Callable[[random.Random, str], tuple[list[str], str]]] = {
    "underflow_without_scaler": _underflow,
    "forward_overflow": _overflow,
    "lr_too_high": _lr_too_high,
    "init_scale_too_high": _init_scale,
    "eager_scale_growth": _eager_growth,
    "clip_before_unscale": _clip,
    "no_scaler_update": _no_update,
    "update_every_microbatch": _per_micro_batch,
    "fp16_weights_without_masters": _half_model,
    "loss_in_low_precision": _loss_low,
    "healthy": _healthy,
    "one_transient_inf_step": _transient,
}


def draw(n: int, seed: int, models: list[str] | None = None, steps: int = 12) -> list[Case]:
    """`n` cases, the classes in turn in a seeded order, each varied by the generator; the
    model among `models` (default all of MODELS)."""
    chosen = models or list(MODELS)
    unknown = [m for m in chosen if m not in MODELS]
    if unknown:
        raise ConfigError(f"unknown --models {', '.join(unknown)}; models: {', '.join(MODELS)}")
    weights = [MODEL_WEIGHTS[list(MODELS).index(m)] for m in chosen]
    r = random.Random(seed)
    classes = list(CLASSES)
    cases: list[Case] = []
    while len(cases) < n:
        r.shuffle(classes)
        for name in classes[: n - len(cases)]:
            model = r.choices(chosen, weights=weights)[0]
            overrides, cause = CLASSES[name](r, model)
            common = [
                *MODELS[model][0],
                f"optim={r.choice(['sgd', 'adamw'])}",
                f"trainer.batch_size={r.choice([8, 16])}",  # small: 2 shared CPU cores
                "data.val_fraction=0.05",
                "trainer.device=cpu",
            ]
            common.append(f"trainer.grad_accum={r.choice([1, 1, 2])}")
            # what the class sets itself (the optimizer, the accumulation) is its own
            common = [o for o in common if key(o) not in {key(c) for c in overrides}]
            cases.append(
                Case(
                    f"{len(cases) + 1:02d}_{name}_{model}",
                    (*common, *overrides),
                    cause,
                    steps,
                    base=(),
                    kind=name,
                )
            )
    return cases
