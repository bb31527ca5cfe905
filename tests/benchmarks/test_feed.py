"""`--parts feed`: the same model on synthetic data, then on JPEG files decoded on the host and
on the device, with each run's data share."""

from __future__ import annotations

import json

import pytest
from helpers.peers import FILE_BENCH

from benchmarks import bench


@pytest.mark.slow
def test_feed_compares_synthetic_and_both_decode_paths_on_jpeg_files(tmp_path):
    out = tmp_path / "out"
    code = bench.main(
        [
            "--parts",
            "feed",
            *FILE_BENCH,
            "--precisions",
            "bf16",
            "--warmup",
            "2",
            "--out",
            str(out),
            "--override",
            "logger=disabled",
            "trainer.log_every=2",
        ]
    )
    assert code == 0
    rows = json.loads((out / "bench.json").read_text())["feed"]
    assert [r["data"] for r in rows] == [
        "synthetic",
        "imagefolder decode=cpu",
        "imagefolder decode=device",  # on CUDA: decode=gpu
    ]
    # synthetic JPEG files, 4 batches of 8, written for it
    assert len(list((out / "peer_images" / "train").glob("*/*.jpg"))) == 32
    for row in rows:
        run = out / "runs" / f"feed_test_vit_{row['data'].split('=')[-1]}"
        summary = json.loads((run / "summary.json").read_text())
        assert row["samples_per_s"] == summary["mean_samples_per_s"]  # the run's own figure
        assert summary["steps"] == 6
    assert rows[0]["vs_synthetic"] == 1.0
    # slicing tensors in device memory waits for nothing; reading and decoding files does
    assert rows[0]["data_share"] < min(rows[1]["data_share"], rows[2]["data_share"])
    assert "| test_vit | bf16 | imagefolder decode=cpu | 0 |" in (out / "bench.md").read_text()
