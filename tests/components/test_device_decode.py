"""data.decode=device|gpu: JPEG bytes from the workers, decoded and augmented on the device."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import run_cli, settings

from amp_lab.build import build
from amp_lab.components import device_decode
from amp_lab.components.data import EpochBatchSampler, build_data
from amp_lab.config import ConfigError
from amp_lab.trainer import Trainer
from benchmarks.image_folder import write_image_folder

# one uint8 step in normalised units is 1 / 255 / std (test_vit's pretrained std is 0.5): the
# PIL and torchvision JPEG decoders and resizers may round a pixel one step apart
ONE_STEP = 1 / 255 / 0.5


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory):
    """A tiny ImageFolder of real 24x24 JPEG files, train/ and val/ inside, 4 classes."""
    return write_image_folder(tmp_path_factory.mktemp("jpegs"), 24, train=32, val=12, classes=4)


def _data(root, *overrides, device="cpu"):
    cfg = settings(
        "data=imagefolder",
        f"data.root={root}",
        "data.img_size=16",
        "data.num_workers=0",
        *overrides,
    ).data
    return build_data(cfg, 0, torch.device(device), "test_vit")


@pytest.mark.parametrize("crop_pct", ["1.0", "0.875"])  # 1.0: decode only; 0.875: resize too
def test_device_decode_gives_the_pil_paths_images(jpegs, crop_pct):
    pil = _data(jpegs, f"data.crop_pct={crop_pct}")
    device = _data(jpegs, f"data.crop_pct={crop_pct}", "data.decode=device")
    (a, labels_a), (b, labels_b) = next(pil.val_batches(12)), next(device.val_batches(12))
    assert a.shape == b.shape == (12, 3, 16, 16) and b.dtype == torch.float32
    assert torch.equal(labels_a, labels_b)
    assert (a - b).abs().max() <= ONE_STEP * 1.0001  # within the decoders' rounding
    assert (a - b).abs().mean() < 0.05 * ONE_STEP  # and almost every pixel identical


def test_each_batch_is_one_decode_jpeg_call_on_the_files_bytes(jpegs, monkeypatch):
    calls = []
    real = device_decode.decode_jpeg

    def spy(encoded, **kwargs):
        calls.append((len(encoded), encoded[0].dtype, kwargs["device"]))
        return real(encoded, **kwargs)

    monkeypatch.setattr(device_decode, "decode_jpeg", spy)
    data = _data(jpegs, "data.decode=device", "data.augment=true")
    images, labels = next(data.train_batches(EpochBatchSampler(len(data.train), 8, seed=0)))
    assert calls == [(8, torch.uint8, torch.device("cpu"))]  # the whole batch, still encoded
    assert images.shape == (8, 3, 16, 16) and labels.shape == (8,)
    # the random-resized crop and jitter ran: training images differ from the evaluation ones
    evaluation = _data(jpegs, "data.decode=device", "data.augment=false")
    same, _ = next(evaluation.train_batches(EpochBatchSampler(len(data.train), 8, seed=0)))
    assert not torch.allclose(images, same, atol=2 * ONE_STEP)


def test_a_device_decode_run_trains_and_reports_its_data_share(jpegs, tmp_path):
    summary = Trainer(
        build(
            settings(
                "data=imagefolder",
                f"data.root={jpegs}",
                "data.img_size=16",
                "data.num_workers=2",  # the files' bytes come from worker processes
                "data.decode=device",
                "trainer.batch_size=8",
                "trainer.max_steps=6",
            ),
            tmp_path,
        )
    ).fit()
    assert summary["steps"] == 6 and summary["final_val_acc"] is not None
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    shares = [r["throughput/data_share"] for r in rows if "throughput/data_share" in r]
    # decoding 8 files a step is a measurable part of a 16-px test_vit step
    assert shares and all(0.0 < share <= 1.0 for share in shares)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.decode=gpu"], "data.decode=gpu needs a CUDA training device, not cpu; use"),
        (
            ["data.decode=device", "data.auto_augment=rand-m9-mstd0.5"],
            "data.decode=device decodes data=imagefolder's JPEGs with crop, flip and colour "
            "jitter only, not data.auto_augment; use data.decode=cpu",
        ),
    ],
)
def test_what_the_device_path_cannot_do_is_refused(jpegs, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _data(jpegs, *overrides)


def test_decode_on_the_device_needs_an_imagefolder():
    with pytest.raises(ConfigError, match="not data=digits; use data.decode=cpu"):
        settings("data=digits", "data.decode=device")


def test_png_files_under_device_decode_are_named(tmp_path):
    root = write_image_folder(tmp_path / "pngs", 16, train=4, val=2, classes=2, image_format="png")
    with pytest.raises(ConfigError, match=r"decodes JPEG files only, and .* holds 4 others"):
        _data(root, "data.decode=device")
    assert _data(root).train  # the default CPU path reads them


@pytest.mark.slow
def test_decode_gpu_without_cuda_is_one_line_and_exit_2(jpegs, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine runs data.decode=gpu")
    result = run_cli(
        "model=test_vit",
        "data=imagefolder",
        f"data.root={jpegs}",
        "data.decode=gpu",
        "trainer.device=cpu",
        "logger=disabled",
        f"hydra.run.dir={tmp_path / 'run'}",
        cwd=tmp_path,
    )
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()
    assert len(last) == 1 and "data.decode=gpu needs a CUDA training device" in last[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_decode_gives_the_pil_paths_images(jpegs):
    pil = _data(jpegs, device="cuda")
    gpu = _data(jpegs, "data.decode=gpu", device="cuda")
    (a, _), (b, _) = next(pil.val_batches(12)), next(gpu.val_batches(12))
    assert b.device.type == "cuda"
    assert (a - b).abs().max() <= 8 * ONE_STEP  # nvJPEG rounds its own way
