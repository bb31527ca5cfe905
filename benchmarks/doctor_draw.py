"""Drawn doctor cases: variations of every failure class that the fixed suite (suite.py) does not
contain, so its figures measure the doctor on cases it was not written against.

`python -m benchmarks.doctor_suite --draw N --seed S` draws N cases, the classes in turn (every
class appears once per round), each with a model among the test ViT, the test ConvNeXt and
resnet18 at 32 px, a module, a fault magnitude, an optimizer (SGD, AdamW), a batch size and an
accumulation from the seeded generator; the same seed draws the same cases.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from amp_lab.config import ConfigError
from benchmarks.doctor_cases import Case

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


Overrides = Callable[[random.Random, str], list[str]]  # (generator, model) -> the class's
# failure class -> (the cause the doctor must name, its overrides drawn for a model)
CLASSES: dict[str, tuple[str, Overrides]] = {
    # the loss (and with it every gradient) shrunk until fp16 flushes most gradients; AdamW,
    # whose update does not depend on the gradient's size: under SGD fp32 stops training too
    "underflow_without_scaler": (
        "underflow_no_scaler",
        lambda r, model: [
            "precision=fp16_noscale",
            "optim=adamw",
            f"fault.loss_multiplier={r.choice([1e-5, 1e-6, 1e-7])}",
        ],
    ),
    # each factor passes fp16's 65504 from activations of ~1e-2
    "forward_overflow": (
        "forward_overflow",
        lambda r, model: [
            FP16,
            f"fault.overflow_module={MODELS[model][1](r)}",
            f"fault.overflow_factor={r.choice([1e7, 1e8, 1e9]):g}",
        ],
    ),
    "lr_too_high": ("baseline", lambda r, model: [FP16, f"lr.base={r.choice([2, 5, 10])}"]),
    "init_scale_too_high": (
        "init_scale_high",
        lambda r, model: [FP16, f"scaler.init_scale={r.choice([1e12, 1e15, 1e18]):g}"],
    ),
    "eager_scale_growth": (
        "eager_growth",
        lambda r, model: [
            FP16,
            "scaler.growth_interval=1",
            f"scaler.growth_factor={r.choice([4, 8, 16])}",
        ],
    ),
    "clip_before_unscale": (
        "clip_before_unscale",
        lambda r, model: [
            FP16,
            "pitfall=clip_before_unscale",
            f"trainer.clip_grad={r.choice([0.5, 1.0, 5.0])}",
        ],
    ),
    "no_scaler_update": ("no_scaler_update", lambda r, model: [FP16, "pitfall=no_scaler_update"]),
    # the mistake needs accumulation: with one micro-batch per step it is the correct step
    "update_every_microbatch": (
        "update_every_microbatch",
        lambda r, model: [
            FP16,
            "pitfall=update_every_microbatch",
            f"trainer.grad_accum={r.choice([2, 3])}",
        ],
    ),
    "fp16_weights_without_masters": ("half_model", lambda r, model: [FP16, "pitfall=half_model"]),
    "loss_in_low_precision": (
        "loss_in_low_precision",
        lambda r, model: [FP16, "pitfall=loss_in_low_precision"],
    ),
    "healthy": ("none", lambda r, model: [f"precision={r.choice(['fp32', 'fp16', 'bf16'])}"]),
    "one_transient_inf_step": (
        "transient",
        lambda r, model: [FP16, f"fault.inf_grad_at_step={r.randrange(2, 9)}"],
    ),
}


def draw(n: int, seed: int, models: list[str] | None = None) -> list[Case]:
    """`n` cases, the classes in turn in a seeded order, each varied by the generator; the
    model among `models` (default all of MODELS)."""
    from amp_lab.tools.doctor.probes import key  # torch loads once the arguments are read

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
            cause, drawn = CLASSES[name]
            overrides = drawn(r, model)
            common = [
                *MODELS[model][0],
                f"optim={r.choice(['sgd', 'adamw'])}",
                f"trainer.batch_size={r.choice([8, 16])}",  # small: 2 shared CPU cores
                "data.val_fraction=0.05",
                "trainer.device=cpu",
                f"trainer.grad_accum={r.choice([1, 1, 2])}",
            ]
            # what the class sets itself (the optimizer, the accumulation) is its own
            common = [o for o in common if key(o) not in {key(c) for c in overrides}]
            label = f"{len(cases) + 1:02d}_{name}_{model}"
            cases.append(Case(label, (*common, *overrides), cause, base=(), kind=name))
    return cases
