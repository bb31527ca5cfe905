"""`--parts peer`: timm's train.py arguments from amp_lab's settings, its log read back, and the
alternated whole runs, against a small fake peer the tests write (CI has no timm checkout)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import settings
from helpers.peers import FILE_BENCH, write_fake_peer

from amp_lab.components.lr import peak_lr
from amp_lab.config import ConfigError
from benchmarks import bench
from benchmarks.image_folder import write_image_folder
from benchmarks.timm_peer import timm_args, timm_rate


def _arg(args: list[str], flag: str, n: int = 1) -> list[str]:
    return args[args.index(flag) + 1 : args.index(flag) + 1 + n]


def test_timms_arguments_follow_amp_labs_settings(tmp_path):
    s = settings("precision=bf16", "data=imagefolder", "data.root=x", "data.augment=false")
    args = timm_args(s, tmp_path, 10, torch.device("cpu"), tmp_path / "out")
    assert _arg(args, "--model", 3) == ["test_vit", "--model-kwargs", "patch_size=4"]
    assert _arg(args, "--model-kwargs", 2) == ["patch_size=4", "img_size=16"]
    assert _arg(args, "--amp-dtype") == ["bfloat16"] and "--amp" in args
    assert _arg(args, "-b") == ["16"] and _arg(args, "--input-size", 3) == ["3", "16", "16"]
    assert float(_arg(args, "--lr")[0]) == peak_lr(s.lr, 16)
    assert _arg(args, "--opt") == ["adamw"] and _arg(args, "--weight-decay") == ["0.05"]
    assert "--no-aug" in args and "--no-prefetcher" in args and _arg(args, "-j") == ["8"]
    assert _arg(args, "--log-interval") == ["1"] and _arg(args, "--smoothing") == ["0.0"]
    assert not any(a.startswith("--torchcompile") for a in args)  # trainer.compile=off: eager
    # a CNN takes no img_size; a channels_last preset asks timm for NHWC too
    cnn = timm_args(settings("model=resnet18"), tmp_path, 10, torch.device("cpu"), tmp_path)
    assert "--model-kwargs" not in cnn and "--channels-last" in cnn
    assert "--amp" not in cnn  # fp32


def test_timm_compiles_exactly_when_amp_lab_compiles_its_model(tmp_path):
    def args(*overrides):
        return timm_args(settings(*overrides), tmp_path, 10, torch.device("cpu"), tmp_path)

    assert not any(a.startswith("--torchcompile") for a in args("trainer.compile=off"))
    assert "--torchcompile=inductor" in args("trainer.compile=model")
    compiled = args("trainer.compile=model", "trainer.compile_backend=aot_eager")
    assert "--torchcompile=aot_eager" in compiled
    with pytest.raises(ConfigError, match="use trainer.compile=model"):
        args("trainer.compile=step")


def test_a_mode_timm_has_not_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"timm's train.py has no precision=tf32; use one of"):
        timm_args(settings("precision=tf32"), tmp_path, 10, torch.device("cpu"), tmp_path)


def test_timms_rate_is_the_harmonic_mean_of_the_updates_after_warmup():
    lines = [
        f"Train: 0 [   {i}/4 ( 25%)]  Loss: 2.30 (2.30)  Time: 0.080s,  {r:>7.2f}/s  "
        f"(0.080s,  {r:>7.2f}/s)  LR: 1.000e-03  Data: 0.010 (0.010)"
        for i, r in enumerate([1.0, 100.0, 200.0, 100.0])
    ]
    assert timm_rate("\n".join(["noise", *lines]), warmup=1) == (pytest.approx(120.0), 3)
    with pytest.raises(ConfigError, match="none after the 4 warm-up ones"):
        timm_rate("\n".join(lines), warmup=4)
    with pytest.raises(ConfigError, match="is --peer-script timm's train.py"):
        timm_rate("Epoch 1 done", warmup=1)


TINY = ["--parts", "peer", *FILE_BENCH, "--epochs", "1"]


@pytest.fixture
def fake_peer(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_PEER_RECORD", str(tmp_path / "record.jsonl"))
    return write_fake_peer(tmp_path)


def test_bad_peer_input_is_one_line_and_exit_2(tmp_path, capsys, fake_peer, monkeypatch):
    def error(*args: str) -> str:
        assert bench.main([*TINY, "--out", str(tmp_path / "out"), *args]) == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]  # after torchao's import warning
        assert last.startswith("amp_lab bench: error:")
        return last

    assert "needs --peer-script path/to/timm/train.py" in error()
    # checked before any other part measures anything
    assert "needs --peer-script" in error("--parts", "overhead", "peer")
    assert not (tmp_path / "out" / "bench.json").exists()
    assert "needs --peer-script" in error("--peer-script", str(tmp_path / "missing.py"))
    flat = write_image_folder(tmp_path / "flat", 16, train=2, val=1)
    assert "needs train/<class>/ and val/<class>/ inside" in error(
        "--peer-script", str(fake_peer), "--data-dir", str(flat / "train")
    )
    monkeypatch.setenv("FAKE_PEER_FAIL", "1")
    line = error("--peer-script", str(fake_peer))
    assert "failed (exit 1): RuntimeError: out of patience; its whole log:" in line


@pytest.mark.slow
def test_the_peer_part_alternates_whole_runs_and_reports_the_ratio(tmp_path, fake_peer):
    out = tmp_path / "out"
    code = bench.main(
        [
            *TINY,
            "--peer-script",
            str(fake_peer),
            "--precisions",
            "bf16",
            "--rounds",
            "2",
            "--out",
            str(out),
            "--override",
            "logger=disabled",
            "trainer.timing_warmup=1",
            "trainer.log_every=2",
        ]
    )
    assert code == 0
    (peer,) = json.loads((out / "bench.json").read_text())["peer"]
    runs = peer["runs"]
    assert [(r["program"], r["round"]) for r in runs] == [
        ("peer", 0),
        ("amp_lab", 0),
        ("peer", 1),
        ("amp_lab", 1),
    ]
    record = [json.loads(line) for line in (tmp_path / "record.jsonl").read_text().splitlines()]
    # the fake ran at the recorded starts, each round's amp_lab run between the two peer runs
    assert [r["started"] for r in runs if r["program"] == "peer"] == pytest.approx(
        [r["time"] for r in record], abs=1.0
    )
    assert runs[0]["started"] < runs[1]["started"] < record[1]["time"] < runs[3]["started"]
    # both read the same synthetic JPEGs, 4 batches of 8 for the one epoch
    assert _arg(record[0]["argv"], "--data-dir") == [str(out / "peer_images")]
    assert len(list((out / "peer_images" / "train").glob("*/*.jpg"))) == 32
    assert _arg(record[0]["argv"], "--epochs") == ["1"]
    for r in runs:
        if r["program"] == "peer":  # the updates after the first: 8 / (8/100 + 8/200 + 8/100)
            assert (r["samples_per_s"], r["counted_steps"]) == (pytest.approx(120.0), 3)
        else:  # amp_lab's own summary: 4 steps, 3 timed
            summary = json.loads(
                (
                    out / "peer" / "test_vit_bf16" / f"amp_lab_{r['round']}" / "summary.json"
                ).read_text()
            )
            assert r["samples_per_s"] == summary["mean_samples_per_s"] and r["counted_steps"] == 3
        assert r["wall_s"] > 0
    amp_lab = [r["samples_per_s"] for r in runs if r["program"] == "amp_lab"]
    assert peer["ratios"] == pytest.approx([rate / 120.0 for rate in amp_lab])  # per round
    assert peer["ratio"] == pytest.approx(sum(amp_lab) / 2 / 120.0)  # the median of two
    md = (out / "bench.md").read_text()
    assert "## Peer: amp_lab vs timm's train.py" in md and f"**{peer['ratio']:.3f}**" in md
