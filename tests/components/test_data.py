"""Data sets from real on-disk formats, and the deterministic, resumable batch order."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import settings
from PIL import Image

from amp_lab.build import build
from amp_lab.components.data import EpochBatchSampler, build_data, load_digits
from amp_lab.trainer import Trainer


def test_sampler_is_a_function_of_seed_and_epoch():
    a, b = EpochBatchSampler(100, 8, seed=3), EpochBatchSampler(100, 8, seed=3)
    a.set_epoch(2)
    b.set_epoch(2)
    assert list(a) == list(b) and len(list(a)) == 12
    b.set_epoch(3)
    assert list(a) != list(b)
    full = list(a)
    a.set_epoch(2, start_batch=5)
    assert list(a) == full[5:]  # resuming mid-epoch continues the same order


def test_digits_are_scikit_learns():
    from sklearn.datasets import load_digits as sklearn_digits

    pixels, target = load_digits()
    digits = sklearn_digits()
    assert np.array_equal(pixels, digits.images) and np.array_equal(target, digits.target)


def test_digits_split_is_deterministic_and_disjoint():
    cfg = settings().data
    one, two = build_data(cfg, 0, torch.device("cpu")), build_data(cfg, 0, torch.device("cpu"))
    assert torch.equal(one.train.tensors[0], two.train.tensors[0])
    assert len(one.train) + len(one.val) == 1797
    assert one.spec.channels == 1 and one.spec.num_classes == 10 and one.spec.img_size == 16
    other = build_data(cfg, 1, torch.device("cpu"))
    assert not torch.equal(one.val.tensors[1], other.val.tensors[1])


def test_synthetic_data_lives_on_the_device_and_shapes_the_model(tmp_path):
    trainer = Trainer(
        build(
            settings(
                "data=synthetic",
                "data.img_size=16",
                "data.num_classes=7",
                "data.num_samples=128",
                "trainer.max_steps=2",
            ),
            tmp_path,
        )
    )
    assert trainer.run.data.spec.num_classes == 7 and trainer.run.data.spec.channels == 3
    assert trainer.run.model.head.out_features == 7
    assert trainer.fit()["steps"] == 2


def _write_image_folder(root, classes=3, per_class=12, size=20):
    rng = np.random.default_rng(0)
    for c in range(classes):
        folder = root / f"class_{c}"
        folder.mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 255, (size, size, 3), dtype=np.uint8)
            pixels[..., c] = 255  # each class has its own bright channel
            Image.fromarray(pixels).save(folder / f"{i}.png")


def test_imagefolder_trains_from_png_files(tmp_path):
    _write_image_folder(tmp_path / "images")
    summary = Trainer(
        build(
            settings(
                "data=imagefolder",
                f"data.root={tmp_path / 'images'}",
                "data.img_size=16",
                "data.num_workers=0",
                "trainer.batch_size=8",
                "trainer.max_steps=4",
            ),
            tmp_path / "run",
        )
    ).fit()
    assert summary["steps"] == 4 and summary["final_val_acc"] is not None


def test_imagefolder_with_train_and_val_folders(tmp_path):
    _write_image_folder(tmp_path / "images" / "train")
    _write_image_folder(tmp_path / "images" / "val", per_class=4)
    data = build_data(
        settings(
            "data=imagefolder",
            f"data.root={tmp_path / 'images'}",
            "data.img_size=16",
            "data.num_workers=0",
        ).data,
        0,
        torch.device("cpu"),
    )
    assert len(data.train) == 36 and len(data.val) == 12 and data.spec.num_classes == 3
    images, labels = next(data.val_batches(5))
    assert images.shape == (5, 3, 16, 16) and labels.dtype == torch.long


def test_an_evaluation_draws_nothing_from_the_training_rng(tmp_path):
    """A DataLoader pass draws its workers' base seed; from the global RNG it would shift the
    training's augmentation and dropout by every evaluation (and differently after a resume)."""
    _write_image_folder(tmp_path / "images")
    data = build_data(
        settings("data=imagefolder", f"data.root={tmp_path / 'images'}", "data.img_size=16").data,
        0,
        torch.device("cpu"),
    )
    before = torch.get_rng_state()
    for _ in range(2):
        assert sum(len(labels) for _, labels in data.val_batches(5)) == len(data.val)
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_cifar_needs_a_local_root_and_never_downloads(name, tmp_path):
    from amp_lab.config import ConfigError

    with pytest.raises(ConfigError, match="not found under data.root"):
        build_data(settings(f"data={name}", f"data.root={tmp_path}").data, 0, torch.device("cpu"))
    assert not any(tmp_path.iterdir())  # nothing was fetched
