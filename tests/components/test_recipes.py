"""Real training recipes: timm's transforms and Mixup, the fp32 recipe losses, the fp32 model EMA
(and the bf16-EMA trap), drop-path, each built from the real configs on tiny real files."""

from __future__ import annotations

import json
import pickle
import re
import signal

import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F
from helpers import run_cli, settings
from helpers.host_reads import watched_fit
from PIL import Image
from timm.data import auto_augment, create_transform
from timm.data.auto_augment import RandAugment
from timm.data.random_erasing import RandomErasing
from timm.data.transforms import RandomResizedCropAndInterpolation
from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
from torchvision import datasets
from torchvision.transforms import InterpolationMode, Normalize

from amp_lab.build import build
from amp_lab.checkpoint.signals import Interrupted
from amp_lab.components.augment import Normalisation, mix_batches, resolve_normalisation
from amp_lab.components.data import build_data
from amp_lab.components.loss import build_loss
from amp_lab.components.models import build_model
from amp_lab.config import ConfigError
from amp_lab.tracking.sinks import Sink
from amp_lab.trainer import Trainer

RECIPE = [
    "data.augment=true",
    "data.auto_augment=rand-m9-mstd0.5-inc1",
    "data.re_prob=0.25",
    "data.mixup_alpha=0.8",
    "data.cutmix_alpha=1.0",
    "data.label_smoothing=0.1",
]


def _image_folder(root, classes=2, per_class=8, size=20):
    """Class folders holding both JPEG and PNG files, each class with its own bright channel."""
    rng = np.random.default_rng(0)
    for c in range(classes):
        (root / f"class_{c}").mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 255, (size, size, 3), dtype=np.uint8)
            pixels[..., c] = 255
            Image.fromarray(pixels).save(root / f"class_{c}" / f"{i}.{('jpg', 'png')[i % 2]}")
    return root


def _cifar10(root, per_batch=8):
    """CIFAR-10's own on-disk format: pickled dicts of uint8 rows (3x32x32, channel-major)."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {
            "data": rng.integers(0, 255, (per_batch, 3072), dtype=np.uint8),
            "labels": [int(x) for x in rng.integers(0, 10, per_batch)],
        }
        (folder / name).write_bytes(pickle.dumps(batch))
    (folder / "batches.meta").write_bytes(
        pickle.dumps({"label_names": [f"class_{i}" for i in range(10)]})
    )
    return root


def _ops(dataset) -> list:
    transform = (dataset.dataset if hasattr(dataset, "dataset") else dataset).transform
    return list(transform.transforms)


def test_imagefolder_recipe_runs_timms_transforms_on_jpeg_and_png(tmp_path):
    root = _image_folder(tmp_path / "images")
    cfg = settings("data=imagefolder", f"data.root={root}", "data.num_workers=0", *RECIPE).data
    data = build_data(cfg, 0, torch.device("cpu"), "test_vit")
    train_ops, val_ops = _ops(data.train), _ops(data.val)
    kinds = [type(op) for op in train_ops]
    assert RandomResizedCropAndInterpolation in kinds and RandomErasing in kinds
    assert any(isinstance(op, RandAugment) for op in train_ops)
    # exactly timm's pipeline, normalised and resized as test_vit's pretrained config says
    pretrained = timm.models.get_pretrained_cfg("test_vit")
    expected = create_transform(
        (3, 16, 16),
        is_training=True,
        auto_augment=cfg.auto_augment,
        re_prob=0.25,
        re_mode="pixel",
        interpolation=pretrained.interpolation,
        mean=pretrained.mean,
        std=pretrained.std,
    )
    assert repr(data.train.dataset.transform) == repr(expected)
    normalize = next(op for op in val_ops if isinstance(op, Normalize))
    assert tuple(normalize.mean) == pretrained.mean == (0.5, 0.5, 0.5)
    files = sorted(p.suffix for p in root.rglob("*.*"))
    assert set(files) == {".jpg", ".png"}
    seen = sum(len(labels) for _, labels in data.val_batches(4)) + len(data.train)
    assert seen == len(files) == 16
    image, _ = data.train[0]
    assert image.shape == (3, 16, 16) and image.dtype == torch.float32


def test_randaugment_posterize_at_full_magnitude_runs_on_this_pillow():
    """`inc1` posterize keeps 4 - 4 * level/10 bits: 0 at magnitude 10, which Pillow 13 refuses
    (amp_lab.components.augment, imported above, gives timm a posterize that takes 0)."""
    op = auto_augment.AugmentOp("PosterizeIncreasing", prob=1.0, magnitude=10)
    image = Image.fromarray(np.full((8, 8, 3), 200, dtype=np.uint8))
    assert np.asarray(op(image)).max() == 0  # nothing kept: black, as Pillow < 13 gave
    assert np.asarray(auto_augment.AugmentOp("PosterizeIncreasing", 1.0, 5)(image)).max() > 0


def test_augment_off_trains_on_the_evaluation_transform_and_data_mean_wins(tmp_path):
    root = _image_folder(tmp_path / "images")
    cfg = settings(
        "data=imagefolder",
        f"data.root={root}",
        "data.augment=false",
        "data.mean=[0.1,0.2,0.3]",
        "data.std=[1,1,1]",
        "data.crop_pct=1.0",
    ).data
    data = build_data(cfg, 0, torch.device("cpu"), "test_vit")
    assert repr(data.train.dataset.transform) == repr(data.val.dataset.transform)
    normalize = next(op for op in _ops(data.val) if isinstance(op, Normalize))
    assert tuple(normalize.mean) == (0.1, 0.2, 0.3)


def test_normalisation_comes_from_the_model_else_the_data_set():
    cfg = settings("data=imagefolder", "data.root=.").data
    data_stats = ((0.1, 0.2, 0.3), (0.4, 0.5, 0.6))
    assert resolve_normalisation(cfg, "test_vit", *data_stats) == Normalisation(
        (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), "bicubic", 0.95
    )
    assert resolve_normalisation(cfg, None, *data_stats) == Normalisation(
        *data_stats, "bilinear", 0.875
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.mixup_alpha=0.8", "trainer.batch_size=15"], "need an even trainer.batch_size"),
        (["data.auto_augment=rand-m9-mstd0.5-inc1"], "data.auto_augment needs image files"),
        (["data.re_prob=0.25"], "data.re_prob needs image files"),
        (["data.scale=[0.5,0.2]"], "data.scale=[0.5, 0.2] must be [min, max] area shares"),
        (["data.mean=[0.5]"], "data.mean=[0.5] must hold 3 channel values"),
    ],
)
def test_recipe_settings_that_cannot_apply_are_one_line_errors(overrides, message, tmp_path):
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        Trainer(build(settings(*overrides), tmp_path))
    assert "\n" not in str(err.value)


def test_imagenet_deit_preset_is_deits_data_recipe(tmp_path):
    cfg = settings("data=imagenet_deit", f"data.root={_image_folder(tmp_path / 'i')}").data
    assert (
        cfg.name,
        cfg.auto_augment,
        cfg.re_prob,
        cfg.mixup_alpha,
        cfg.cutmix_alpha,
        cfg.mixup_switch_prob,
        cfg.label_smoothing,
        cfg.interpolation,
    ) == ("imagefolder", "rand-m9-mstd0.5-inc1", 0.25, 0.8, 1.0, 0.5, 0.1, "bicubic")
    data = build_data(cfg, 0, torch.device("cpu"), "deit_small_patch16_224")
    crop = next(op for op in _ops(data.train) if isinstance(op, RandomResizedCropAndInterpolation))
    assert crop.interpolation == InterpolationMode.BICUBIC and crop.scale == (0.08, 1.0)


def test_cifar_file_format_trains_through_the_recipe(tmp_path, monkeypatch):
    root = _cifar10(tmp_path / "cifar")
    # torchvision checks the real files' md5 sums; these are fakes in the same format
    monkeypatch.setattr(datasets.cifar, "check_integrity", lambda *args: True)
    trainer = Trainer(
        build(
            settings(
                "data=cifar10",
                "+recipe=deit",
                f"data.root={root}",
                "data.num_workers=0",
                "data.img_size=32",
                "data.crop_pct=1.0",
                "trainer.batch_size=8",
                "trainer.max_steps=2",
            ),
            tmp_path / "run",
        )
    )
    assert len(trainer.run.data.train) == 40 and len(trainer.run.data.val) == 8
    assert any(isinstance(op, RandAugment) for op in _ops(trainer.run.data.train))
    assert trainer.run.mixup is not None and trainer.run.ema is not None  # the recipe's batch side
    summary = trainer.fit()
    assert summary["steps"] == 2 and summary["final_val_acc"] is not None


class LossInputs:
    """Records the dtypes and targets the timm loss receives."""

    def __init__(self, monkeypatch, cls) -> None:
        self.calls: list[tuple[torch.dtype, torch.Tensor]] = []
        forward = cls.forward

        def recording(loss, x, target):
            self.calls.append((x.dtype, target.detach().clone()))
            return forward(loss, x, target)

        monkeypatch.setattr(cls, "forward", recording)


def test_mixup_soft_targets_reach_an_fp32_loss_under_bf16_pure(tmp_path, monkeypatch):
    seen = LossInputs(monkeypatch, SoftTargetCrossEntropy)
    trainer = Trainer(
        build(
            settings(
                "precision=bf16_pure",
                "data.mixup_alpha=0.8",
                "data.cutmix_alpha=1.0",
                "data.label_smoothing=0.1",
                "trainer.max_steps=3",
            ),
            tmp_path,
        )
    )
    assert next(trainer.run.model.parameters()).dtype == torch.bfloat16  # the logits are bf16
    batch = next(trainer.run.data.train_batches(trainer.run.sampler))
    ((images, target),) = mix_batches(trainer.run.mixup, [batch])
    assert images.dtype == torch.float32 and target.shape == (16, 10)  # blended before autocast
    summary = trainer.fit()
    assert summary["steps"] == 3 and len(seen.calls) == 3
    for dtype, target in seen.calls:
        assert dtype == torch.float32 and target.dtype == torch.float32
        torch.testing.assert_close(target.sum(-1), torch.ones(16))
        assert target.max() < 1.0 and target.min() >= 0.1 / 10  # blended and smoothed
    val = [json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(0.0 <= r["val/acc"] <= 1.0 for r in val if r["kind"] == "val")  # hard labels


def test_label_smoothing_alone_is_timms_smoothing_loss_in_fp32(monkeypatch):
    loss = build_loss(settings("data.label_smoothing=0.1").data)
    logits = torch.randn(8, 10).to(torch.bfloat16)
    labels = torch.randint(0, 10, (8,))
    seen = LossInputs(monkeypatch, LabelSmoothingCrossEntropy)
    expected = F.cross_entropy(logits.float(), labels, label_smoothing=0.1)
    torch.testing.assert_close(loss(logits, labels), expected)
    assert seen.calls[0][0] == torch.float32


def test_the_digits_tensor_path_takes_mixup_and_label_smoothing(tmp_path):
    trainer = Trainer(
        build(
            settings("data.mixup_alpha=0.4", "data.label_smoothing=0.1", "trainer.max_steps=4"),
            tmp_path,
        )
    )
    images, labels = trainer.run.data.train.tensors
    assert images.shape[1:] == (1, 16, 16) and labels.dtype == torch.long  # no transforms
    summary = trainer.fit()
    rows = [json.loads(r) for r in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    assert summary["steps"] == 4 and all(np.isfinite(r["train/loss"]) for r in train)
    assert all(0.0 <= r["train/acc"] <= 1.0 for r in train)


def test_drop_path_rate_is_timms_stochastic_depth():
    spec = build_data(settings().data, 0, torch.device("cpu")).spec
    model = build_model(settings("model.drop_path_rate=0.1").model, spec)
    rates = [block.drop_path1 for block in model.blocks]
    assert isinstance(rates[0], torch.nn.Identity)  # timm: 0 at the first block ...
    assert rates[-1].drop_prob == pytest.approx(0.1)  # ... rising to the rate at the last
    plain = build_model(settings().model, spec)
    assert all(isinstance(b.drop_path1, torch.nn.Identity) for b in plain.blocks)


EMA_RUN = [
    "trainer.max_steps=8",
    "trainer.log_every=1",
    "trainer.eval_every=4",
    "data.val_fraction=0.05",
    "checkpoint.every_minutes=0",
    "trainer.ema.decay=0.9",
    "trainer.ema.every=2",
    "data.mixup_alpha=0.8",
]


class SignalAt(Sink):
    def __init__(self, step: int) -> None:
        self.step = step

    def log(self, record: dict) -> None:
        if record["kind"] == "train" and record["step"] == self.step:
            signal.raise_signal(signal.SIGUSR2)


def _val(run_dir) -> list[tuple]:
    rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["val/acc_ema"], r["val/loss_ema"]) for r in rows if r["kind"] == "val"]


def test_ema_is_checkpointed_and_resumes_exactly(tmp_path):
    whole = Trainer(build(settings(*EMA_RUN), tmp_path / "whole"))
    whole.fit()
    with pytest.raises(Interrupted):
        Trainer(build(settings(*EMA_RUN), tmp_path / "split"), [SignalAt(5)]).fit()
    resumed = Trainer(build(settings(*EMA_RUN), tmp_path / "split"))
    assert resumed.run.state.step == 5
    resumed.fit()
    assert _val(tmp_path / "split") == _val(tmp_path / "whole") and len(_val(tmp_path / "whole"))
    for a, b in zip(whole.run.ema.state_dict().values(), resumed.run.ema.state_dict().values()):
        assert torch.equal(a, b)
    assert next(whole.run.ema.module.parameters()).dtype == torch.float32


def _moved_share(trainer: Trainer) -> float:
    """Share of the EMA's weight-matrix entries of size >= 1e-2 that moved from their initial
    value (half a bf16 ulp there is >= 2**-15, about 3e-5; entries nearer zero have finer steps)."""
    before = {k: v.clone() for k, v in trainer.run.ema.module.state_dict().items() if v.ndim >= 2}
    trainer.fit()
    after = trainer.run.ema.module.state_dict()
    sized = {k: v.abs() >= 1e-2 for k, v in before.items()}
    moved = sum(int((after[k] != v.to(after[k].dtype))[sized[k]].sum()) for k, v in before.items())
    return moved / sum(int(mask.sum()) for mask in sized.values())


def test_a_bf16_ema_stops_moving_on_bf16_pure_while_the_fp32_ema_tracks(tmp_path):
    """decay 0.9999: each update is 1e-4 of (weights - ema); six AdamW steps at lr 1e-2 move a
    weight by at most ~6e-2, so an update is <= ~6e-6: under half a bf16 ulp of any entry
    >= 1e-2."""
    run = ["precision=bf16_pure", "trainer.max_steps=6", "trainer.ema.decay=0.9999", "lr.base=1e-2"]
    fp32 = Trainer(build(settings(*run), tmp_path / "fp32"))
    bf16 = Trainer(build(settings(*run, "trainer.ema.fp32=false"), tmp_path / "bf16"))
    assert next(bf16.run.ema.module.parameters()).dtype == torch.bfloat16
    assert next(fp32.run.ema.module.parameters()).dtype == torch.float32
    fp32_moved, bf16_moved = _moved_share(fp32), _moved_share(bf16)
    assert fp32_moved > 0.95, fp32_moved  # every update lands in fp32
    assert bf16_moved == 0.0, bf16_moved  # every update rounded away
    # the fp32 EMA moved towards the trained weights
    weights = fp32.run.model.state_dict()
    start = Trainer(build(settings(*run), tmp_path / "init")).run.model.state_dict()
    for key, ema in fp32.run.ema.module.state_dict().items():
        if ema.ndim >= 2:
            w = weights[key].float()
            assert (w - ema).norm() < (w - start[key].float()).norm()


def test_an_imagefolder_recipe_run_reports_its_data_share(tmp_path):
    root = _image_folder(tmp_path / "images", per_class=20)
    Trainer(
        build(
            settings(
                "data=imagefolder",
                f"data.root={root}",
                "data.num_workers=0",
                *RECIPE,
                "trainer.batch_size=8",
                "trainer.max_steps=4",
                "trainer.log_every=2",
            ),
            tmp_path / "run",
        )
    ).fit()
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    shares = [r["throughput/data_share"] for r in rows if "throughput/data_share" in r]
    assert shares and all(0.0 < s <= 1.0 for s in shares)


def test_mixup_and_the_ema_add_no_host_reads_between_log_steps(monkeypatch, tmp_path):
    trainer = Trainer(
        build(
            settings(
                "precision=bf16",
                "data.mixup_alpha=0.8",
                "data.cutmix_alpha=1.0",
                "trainer.ema.decay=0.99",
                "trainer.max_steps=5",
                "trainer.log_every=2",
                "data.val_fraction=0.05",
            ),
            tmp_path,
        )
    )
    assert watched_fit(monkeypatch, trainer).calls == []


@pytest.mark.slow
@pytest.mark.parametrize(
    "override, message",
    [
        ("data.auto_augment=rand-bogus9", "data.auto_augment='rand-bogus9' is not a timm policy"),
        ("data.mixup_alpha=-0.5", "data.mixup_alpha=-0.5 must be >= 0 (0: off)"),
        ("trainer.ema.decay=1.5", "trainer.ema.decay=1.5 must be in [0, 1), e.g. 0.9999"),
    ],
)
def test_bad_recipe_input_is_one_line_and_exit_2(override, message, tmp_path):
    root = _image_folder(tmp_path / "images")
    run_dir = tmp_path / "run"
    result = run_cli(
        "model=test_vit",
        "data=imagefolder",
        f"data.root={root}",
        "data.img_size=16",
        "data.augment=true",
        "logger.mode=disabled",
        "trainer.device=cpu",
        override,
        f"hydra.run.dir={run_dir}",
        cwd=tmp_path,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("amp_lab: error: ") and message in lines[0]
    assert not (run_dir / "metrics.jsonl").exists()
