"""Data sets and a deterministic, resumable batch order.

An epoch's order is a permutation drawn from (seed, epoch) alone, so a run can be repeated and
resumed from any batch. In-memory data (digits, synthetic) is sliced from device tensors; files
go through a DataLoader, or with `data.decode=device|gpu` are decoded on the device.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias

import numpy as np
import torch
from torch.utils.data import DataLoader, Subset, TensorDataset

from amp_lab.choices import Decode
from amp_lab.components.augment import build_transforms, resolve_normalisation
from amp_lab.components.device_decode import (
    DeviceDecoder,
    EncodedImages,
    collate_encoded,
    encoded_folder,
)
from amp_lab.config import ConfigError, DataConfig

if TYPE_CHECKING:
    from torchvision.datasets import VisionDataset

Batch = tuple[torch.Tensor, torch.Tensor]
# The data sets built here: map-style, each with a length (torch's Dataset promises no len()).
MapData: TypeAlias = "TensorDataset | Subset | VisionDataset | EncodedImages"


@dataclass(frozen=True)
class DataSpec:
    """What the model must match: input channels, classes and image size."""

    channels: int
    num_classes: int
    img_size: int


class EpochBatchSampler:
    """Batches of indices in a permutation fixed by (seed, epoch); can start mid-epoch. Each
    global batch is cut into one slice per rank: together the ranks see what one process would."""

    def __init__(
        self, num_samples: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1
    ) -> None:
        self.num_samples, self.batch_size, self.seed = num_samples, batch_size, seed
        self.rank, self.world_size = rank, world_size
        self.epoch, self.start_batch = 0, 0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.epoch, self.start_batch = epoch, start_batch

    def __len__(self) -> int:
        return self.num_samples // (self.batch_size * self.world_size)  # drop the ragged end

    def __iter__(self) -> Iterator[list[int]]:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
        order = torch.randperm(self.num_samples, generator=generator).tolist()
        global_batch = self.batch_size * self.world_size
        for b in range(self.start_batch, len(self)):
            start = b * global_batch + self.rank * self.batch_size
            yield order[start : start + self.batch_size]


@dataclass
class DataSource:
    """A train and a val set plus how to iterate them on the training device."""

    train: MapData
    val: MapData
    spec: DataSpec
    cfg: DataConfig
    device: torch.device
    _loaders: dict = field(default_factory=dict)  # one DataLoader per data set, kept across epochs
    channels_last: bool = False  # batches reach the device in NHWC (model.channels_last)

    def train_batches(self, sampler: EpochBatchSampler) -> Iterator[Batch]:
        return self._batches(self.train, sampler)

    def val_batches(self, batch_size: int) -> Iterator[Batch]:
        n = len(self.val)
        order = [list(range(i, min(n, i + batch_size))) for i in range(0, n, batch_size)]
        return self._batches(self.val, order)  # the same batch size every call: one loader

    def _batches(self, dataset: MapData, batch_order) -> Iterator[Batch]:
        if isinstance(dataset, TensorDataset):  # in memory: index the tensors, no collation
            images, labels = dataset.tensors
            for indices in batch_order:
                idx = torch.as_tensor(indices)
                if images.device.type == "cuda":  # a blocking copy would wait for the GPU
                    idx = idx.pin_memory().to(images.device, non_blocking=True)
                yield self._to_device(images[idx], labels[idx])
            return
        key = id(dataset)
        if key not in self._loaders:  # the sampler is mutated by set_epoch, so one loader serves
            # its own generator: a draw of its workers' base seed from the global RNG would shift
            # the training randomness by every evaluation, and differently after a resume
            self._loaders[key] = DataLoader(
                dataset,
                batch_sampler=batch_order,
                generator=torch.Generator().manual_seed(len(self._loaders)),
                collate_fn=collate_encoded if isinstance(dataset, EncodedImages) else None,
                **self._loader_options(),
            )
        for images, labels in self._loaders[key]:
            if isinstance(dataset, EncodedImages):  # counted in the step's data time
                images = dataset.decoder(images)
            yield self._to_device(images, labels)

    def _loader_options(self) -> dict:
        workers = self.cfg.num_workers
        options = {
            "num_workers": workers,
            "pin_memory": self.cfg.pin_memory and self.device.type == "cuda",
        }
        if workers > 0:
            options.update(
                persistent_workers=self.cfg.persistent_workers,
                prefetch_factor=self.cfg.prefetch_factor,
            )
        return options

    def _to_device(self, images: torch.Tensor, labels: torch.Tensor) -> Batch:
        # non_blocking overlaps the copy with compute when the source is pinned
        memory_format = torch.channels_last if self.channels_last else torch.preserve_format
        return (
            images.to(self.device, non_blocking=True, memory_format=memory_format),
            labels.to(self.device, non_blocking=True),
        )


def _split(n: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = max(1, round(n * val_fraction))
    return order[n_val:], order[:n_val]


def load_digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 1797 8x8 grey digits (values 0-16) and their labels, as its load_digits."""
    # the file scikit-learn ships, without its import (scipy with it: ~3 s of CPU)
    spec = importlib.util.find_spec("sklearn")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            "data=digits reads scikit-learn's digits: pip install scikit-learn"
        )
    rows = np.loadtxt(
        Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz", delimiter=","
    )
    return rows[:, :-1].reshape(-1, 8, 8), rows[:, -1].astype(int)


def _digits(cfg: DataConfig, seed: int) -> tuple[MapData, MapData, DataSpec]:
    pixels, target = load_digits()
    images = torch.tensor(pixels, dtype=torch.float32).unsqueeze(1) / 16.0
    images = torch.nn.functional.interpolate(
        images, size=cfg.img_size, mode="bilinear", align_corners=False
    )
    labels = torch.tensor(target, dtype=torch.long)
    train_idx, val_idx = _split(len(labels), cfg.val_fraction, seed)
    mean, std = images[train_idx].mean(), images[train_idx].std()
    images = (images - mean) / std
    return (
        TensorDataset(images[train_idx], labels[train_idx]),
        TensorDataset(images[val_idx], labels[val_idx]),
        DataSpec(1, 10, cfg.img_size),
    )


def _synthetic(cfg: DataConfig, seed: int, device: torch.device):
    # Random tensors created on the device: throughput runs measure the model, not the loader.
    generator = torch.Generator(device=device).manual_seed(seed)
    shape = (cfg.num_samples, cfg.channels, cfg.img_size, cfg.img_size)
    images = torch.randn(shape, generator=generator, device=device)
    labels = torch.randint(
        0, cfg.num_classes, (cfg.num_samples,), generator=generator, device=device
    )
    n_val = max(1, round(cfg.num_samples * cfg.val_fraction))
    return (
        TensorDataset(images[n_val:], labels[n_val:]),
        TensorDataset(images[:n_val], labels[:n_val]),
        DataSpec(cfg.channels, cfg.num_classes, cfg.img_size),
    )


def _require_root(cfg: DataConfig, how: str) -> Path:
    if not cfg.root or not Path(cfg.root).expanduser().is_dir():
        raise ConfigError(f"data.root={cfg.root} is not a directory; {how}")
    return Path(cfg.root).expanduser()


def _cifar(cfg: DataConfig, model_name: str | None) -> tuple[MapData, MapData, DataSpec]:
    from torchvision import datasets

    classes = 10 if cfg.name == "cifar10" else 100
    cls = datasets.CIFAR10 if classes == 10 else datasets.CIFAR100
    how = (
        f'fetch it once on a machine with network: python -c "import torchvision; '
        f"torchvision.datasets.{cls.__name__}('DIR', download=True)\", then data.root=DIR "
        "(or export CIFAR_ROOT=DIR)"
    )
    root = _require_root(cfg, how)
    norm = resolve_normalisation(
        cfg, model_name, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    )  # CIFAR-10 channel stats
    train_tf, val_tf = build_transforms(cfg, norm)
    try:
        train = cls(str(root), train=True, transform=train_tf)
        val = cls(str(root), train=False, transform=val_tf)
    except RuntimeError as err:  # torchvision: "Dataset not found or corrupted"
        raise ConfigError(f"{cfg.name} not found under data.root={root}; {how}") from err
    return train, val, DataSpec(3, classes, cfg.img_size)


def _imagefolder(
    cfg: DataConfig, seed: int, model_name: str | None, device: torch.device
) -> tuple[MapData, MapData, DataSpec]:
    from torchvision import datasets

    how = "point it at a folder of class sub-folders (or with train/ and val/ inside)"
    root = _require_root(cfg, how)
    if cfg.decode == Decode.gpu and device.type != "cuda":
        raise ConfigError(
            f"data.decode=gpu needs a CUDA training device, not {device.type}; use "
            "data.decode=device (decode on this device) or data.decode=cpu"
        )
    norm = resolve_normalisation(cfg, model_name)  # ImageNet channel stats unless the model's
    transforms = build_transforms(cfg, norm) if cfg.decode == Decode.cpu else None

    def image_set(path: Path, train: bool, indices: list[int] | None = None) -> MapData:
        files: MapData
        if transforms is None:  # the device decodes: the workers only read the files
            files = encoded_folder(path, str(cfg.decode))
        else:
            files = datasets.ImageFolder(str(path), transform=transforms[0 if train else 1])
        files = files if indices is None else Subset(files, indices)
        return (
            files if transforms else EncodedImages(files, DeviceDecoder(cfg, norm, device, train))
        )

    try:
        if (root / "train").is_dir() and (root / "val").is_dir():
            train = image_set(root / "train", True)
            val = image_set(root / "val", False)
            classes, _ = datasets.folder.find_classes(str(root / "train"))  # folders only
        else:
            full = datasets.ImageFolder(str(root))
            train_idx, val_idx = _split(len(full), cfg.val_fraction, seed)
            train = image_set(root, True, train_idx)
            val = image_set(root, False, val_idx)
            classes = full.classes
    except (FileNotFoundError, RuntimeError) as err:
        raise ConfigError(f"data.root={root}: {err}; {how}") from err
    return train, val, DataSpec(3, len(classes), cfg.img_size)


def build_data(
    cfg: DataConfig,
    seed: int,
    device: torch.device,
    model_name: str | None = None,
    channels_last: bool = False,
) -> DataSource:
    """The configured data set, files normalised as `model_name`'s pretrained config says."""
    if cfg.name == "digits":
        train, val, spec = _digits(cfg, seed)
    elif cfg.name == "synthetic":
        train, val, spec = _synthetic(cfg, seed, device)
    elif cfg.name in ("cifar10", "cifar100"):
        train, val, spec = _cifar(cfg, model_name)
    else:
        train, val, spec = _imagefolder(cfg, seed, model_name, device)
    # in memory (both sets, or neither): put them on the device once, not per batch
    if isinstance(train, TensorDataset) and isinstance(val, TensorDataset):
        train, val = (TensorDataset(*(t.to(device) for t in ds.tensors)) for ds in (train, val))
    return DataSource(train, val, spec, cfg, device, channels_last=channels_last)
