"""`python -m benchmarks.image_folder DIR`: a synthetic ImageFolder written as real files.

DIR/train/<class>/*.jpg and DIR/val/<class>/*.jpg: smooth random images, each class tinted its
own way so a model can learn them; amp_lab and timm's train.py then read the same bytes.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torchvision.io import write_jpeg, write_png

from amp_lab.command import parser

JPEG_QUALITY = 90  # a typical photo's quality; the decode cost follows the compressed size


def write_image_folder(
    root: Path, size: int, train: int, val: int, classes: int = 10, image_format: str = "jpeg"
) -> Path:
    """Write `train` and `val` images (spread over `classes`) of size x size pixels, the same
    ones every time; returns root."""
    generator = torch.Generator().manual_seed(0)
    for split, count in (("train", train), ("val", val)):
        for i in range(count):
            label = i % classes
            # low-resolution noise, upsampled: photo-like smooth regions that compress as photos do
            coarse = torch.rand(1, 3, max(2, size // 8), max(2, size // 8), generator=generator)
            image = torch.nn.functional.interpolate(coarse, size=(size, size), mode="bilinear")[0]
            image[label % 3] = 0.5 * image[label % 3] + 0.5 * (label / max(1, classes - 1))
            pixels = (image.clamp(0, 1) * 255).to(torch.uint8)
            folder = root / split / f"class_{label:03d}"
            folder.mkdir(parents=True, exist_ok=True)
            if image_format == "jpeg":
                write_jpeg(pixels, str(folder / f"{i:06d}.jpg"), quality=JPEG_QUALITY)
            else:
                write_png(pixels, str(folder / f"{i:06d}.png"))
    return root


def main(argv: list[str] | None = None) -> int:
    cli = parser("python -m benchmarks.image_folder", __doc__.split("\n\n")[0])
    cli.add_argument("root", type=Path, help="folder to write (train/ and val/ inside)")
    cli.add_argument("--size", type=int, default=224, help="image side in pixels (224)")
    cli.add_argument("--train", type=int, default=1024, help="training images (1024)")
    cli.add_argument("--val", type=int, default=128, help="validation images (128)")
    cli.add_argument("--classes", type=int, default=10, help="class folders (10)")
    cli.add_argument("--format", choices=["jpeg", "png"], default="jpeg")
    args = cli.parse_args(argv)
    if min(args.size, args.train, args.val, args.classes) < 1:
        cli.error("--size, --train, --val and --classes must be >= 1")
    write_image_folder(args.root, args.size, args.train, args.val, args.classes, args.format)
    print(f"wrote {args.train} + {args.val} {args.format} images to {args.root}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
