"""`data.decode=device|gpu`: JPEG files decoded and augmented on the training device.

The loader workers only read each file's bytes; the batch is decoded in one `decode_jpeg` call
(nvJPEG on CUDA) and cropped, flipped and normalised there with timm's geometry: the PIL path's
images, within the decoders' rounding and the resampling kernels' differences.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch.utils.data import Dataset
from torchvision import datasets
from torchvision.io import ImageReadMode, decode_jpeg, read_file
from torchvision.transforms import v2

from amp_lab.components.augment import Normalisation
from amp_lab.config import ConfigError, DataConfig

JPEG_SUFFIXES = (".jpg", ".jpeg")
# timm's `random` interpolation draws bilinear or bicubic per image; one kernel here: bilinear
RANDOM_AS = "bilinear"


def encoded_folder(root: Path, decode: str) -> datasets.ImageFolder:
    """An ImageFolder of (file bytes as a uint8 tensor, class); a non-JPEG file is a ConfigError."""
    folder = datasets.ImageFolder(str(root), loader=read_file)
    others = [path for path, _ in folder.samples if not path.lower().endswith(JPEG_SUFFIXES)]
    if others:
        raise ConfigError(
            f"data.decode={decode} decodes JPEG files only, and {root} holds {len(others)} "
            f"others (e.g. {others[0]}); convert them to JPEG or use data.decode=cpu"
        )
    return folder


Encoded = tuple[torch.Tensor, torch.Tensor]  # a batch's files end to end, and their lengths


def collate_encoded(samples: list[tuple[torch.Tensor, int]]) -> tuple[Encoded, torch.Tensor]:
    """The batch's files as one flat uint8 tensor (one per file would exhaust the file
    descriptors), their lengths, and the labels as one tensor."""
    files = [data for data, _ in samples]
    lengths = torch.tensor([len(data) for data in files])
    return (torch.cat(files), lengths), torch.tensor([label for _, label in samples])


class DeviceDecoder:
    """Encoded JPEGs -> a normalised float32 (N, 3, S, S) batch on `device`."""

    def __init__(
        self, cfg: DataConfig, norm: Normalisation, device: torch.device, train: bool
    ) -> None:
        self.device = device
        name = RANDOM_AS if norm.interpolation == "random" else norm.interpolation
        interpolation = v2.InterpolationMode(name)
        size = cfg.img_size
        if train and cfg.augment:
            steps: list[torch.nn.Module] = [
                v2.RandomResizedCrop(
                    size,
                    scale=(cfg.scale[0], cfg.scale[1]),
                    ratio=(3 / 4, 4 / 3),  # timm's default aspect-ratio range
                    interpolation=interpolation,
                    antialias=True,
                ),
                v2.RandomHorizontalFlip(cfg.hflip),
            ]
            if cfg.color_jitter > 0:  # timm: brightness, contrast and saturation alike
                steps.append(v2.ColorJitter(*[cfg.color_jitter] * 3))
        else:  # timm's evaluation transform: shortest edge to size / crop_pct, then centre crop
            steps = [
                v2.Resize(
                    math.floor(size / norm.crop_pct), interpolation=interpolation, antialias=True
                ),
                v2.CenterCrop(size),
            ]
        self.per_image = v2.Compose(steps)
        self.mean = torch.tensor(norm.mean, device=device).view(1, 3, 1, 1)
        self.std = torch.tensor(norm.std, device=device).view(1, 3, 1, 1)

    def __call__(self, encoded: Encoded) -> torch.Tensor:
        flat, lengths = encoded
        files = list(torch.split(flat, lengths.tolist()))  # views: no copy
        decoded = decode_jpeg(files, mode=ImageReadMode.RGB, device=self.device)
        batch = torch.stack([self.per_image(image) for image in decoded])
        return (batch.float() / 255.0 - self.mean) / self.std  # ToTensor's scale, then Normalize


class EncodedImages(Dataset):
    """A data set of encoded JPEGs and the decoder its batches go through on the device."""

    def __init__(self, files: Dataset, decoder: DeviceDecoder) -> None:
        self.files, self.decoder = files, decoder

    def __len__(self) -> int:
        return len(self.files)  # type: ignore[arg-type]  # ImageFolder/Subset have a length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.files[index]
