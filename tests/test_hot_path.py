"""The hot path: no host-device sync on steps that don't log, and the speed settings in place.

On CPU a sync cannot be observed, so the test counts the calls that would be one on a GPU
(`Tensor.item`, `float(t)`, `int(t)`, `bool(t)`, `.tolist()`, `.cpu()`, `.numpy()`) while a real
Trainer loop runs, outside its log records. On CUDA the same loop runs under
torch.cuda.set_sync_debug_mode("error"), which raises on any synchronising call.
"""

from __future__ import annotations

import pytest
import torch
from helpers import settings
from helpers.host_reads import LOOP, watched_fit

from amp_lab.build import build
from amp_lab.health.monitor import Monitor
from amp_lab.trainer import Trainer

# Loops that cover every branch of the step: each precision, gradient accumulation, both clip
# modes, in-memory digits and on-device synthetic data, a CNN in channels_last.
CASES = {
    "fp32-clip-norm": ["precision=fp32", "trainer.clip_grad=1.0"],
    "fp16-accum-clip-value": [
        "precision=fp16",
        "trainer.grad_accum=2",
        "trainer.batch_size=8",
        "trainer.clip_grad=0.5",
        "trainer.clip_mode=value",
    ],
    "bf16-synthetic-cnn-channels-last": [
        "precision=bf16",
        "data=synthetic",
        "data.img_size=32",
        "data.num_samples=160",
        "data.num_classes=10",
        "model=test_convnext",
        "model.channels_last=true",
    ],
}


@pytest.mark.parametrize("case", list(CASES))
def test_no_host_reads_between_log_steps_on_cpu(monkeypatch, tmp_path, case):
    trainer = Trainer(build(settings(*CASES[case], *LOOP), tmp_path))
    watch = watched_fit(monkeypatch, trainer)
    assert watch.calls == [], watch.calls[0]
    rows = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len([r for r in rows if '"kind": "train"' in r]) == 3  # steps 2, 4 and the last, 5


def test_the_watch_catches_a_host_read_in_the_step(monkeypatch, tmp_path):
    """The check can fail: one `.item()` slipped into the monitor's per-step row is reported."""
    add = Monitor.add

    def add_and_read(self, result):
        add(self, result)
        result.loss.item()

    monkeypatch.setattr(Monitor, "add", add_and_read)
    trainer = Trainer(build(settings(*LOOP), tmp_path))
    watch = watched_fit(monkeypatch, trainer)
    assert len(watch.calls) == 5 and "add_and_read" in watch.calls[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", list(CASES))
def test_no_sync_between_log_steps_on_cuda(monkeypatch, tmp_path, case):
    trainer = Trainer(build(settings(*CASES[case], *LOOP, "trainer.device=cuda"), tmp_path))
    watch = watched_fit(monkeypatch, trainer)  # any sync outside the log records raises
    assert watch.calls == [], watch.calls[0]
    assert torch.backends.cudnn.benchmark


def test_speed_settings_are_on_by_default(tmp_path):
    """Fused optimizers (adamw and sgd), on-device in-memory data, CNN presets in NHWC."""
    for optim in ["adamw", "sgd"]:
        trainer = Trainer(build(settings(f"optim={optim}", "trainer.max_steps=1"), tmp_path))
        assert trainer.run.optimizer.defaults["fused"] is True, optim
    for preset in ["resnet18", "resnet50", "convnext_tiny", "efficientnet_b0"]:
        assert settings(f"model={preset}").model.channels_last, preset
    data = settings("data=cifar10").data
    assert data.num_workers > 0 and data.persistent_workers and data.prefetch_factor >= 2
    assert data.pin_memory


def test_on_disk_loader_takes_workers_and_pinning_from_config(tmp_path):
    from amp_lab.components.data import DataSource

    cfg = settings(
        "data.num_workers=3", "data.prefetch_factor=5", "data.persistent_workers=false"
    ).data
    source = DataSource(None, None, None, cfg, torch.device("cpu"))
    assert source._loader_options() == {
        "num_workers": 3,
        "pin_memory": False,
        "persistent_workers": False,
        "prefetch_factor": 5,
    }
    cuda = DataSource(None, None, None, cfg, torch.device("cuda"))
    assert cuda._loader_options()["pin_memory"] is True  # pinned: non_blocking copies overlap
