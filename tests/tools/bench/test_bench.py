"""`python -m amp_lab bench` end to end on a tiny model, and the FLOPs/peak arithmetic behind MFU.

Structure and sanity only: speed targets are measured by the benchmark, never asserted here.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import timm
import torch
from helpers import ROOT
from helpers.peers import write_fake_peer

from amp_lab.compose import compose_settings
from amp_lab.config import ConfigError
from amp_lab.precision.modes import PRECISION_MODES, resolve_precision
from amp_lab.tools.bench import cli as bench
from amp_lab.tools.bench import flops

TINY = [
    "--models",
    "test_vit",
    "--precisions",
    "fp32",
    "bf16",
    "--img-size",
    "16",
    "--batch-size",
    "8",
    "--steps",
    "2",
    "--rounds",
    "1",
    "--warmup",
    "1",
    "--override",
    "trainer.log_every=2",
    "data.num_classes=10",
    "--device",
    "cpu",
]
DEFAULT = "default (diagnostics=light, W&B offline)"  # the 'default' variant, as labelled


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.fixture(scope="module")
def tiny_bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    variants = ["--variants", "default", "trainer.clip_grad=1.0"]
    code = bench.main([*TINY, *variants, "--repeats", "2", "--out", str(out)])
    return code, out


@pytest.mark.slow
def test_bench_writes_json_with_environment_overhead_and_throughput(tiny_bench):
    code, out = tiny_bench
    assert code == 0
    data = json.loads((out / "bench.json").read_text())
    env = data["environment"]
    assert env["device_type"] == "cpu" and env["torch"] == torch.__version__
    assert env["command"].startswith("python -m amp_lab bench --models test_vit")
    assert env["date"] and env["device"]
    overhead = data["overhead"]  # one row per model x variant x precision, in order
    assert {o["model"] for o in overhead} == {"test_vit"}
    assert [(o["variant"], o["precision"]) for o in overhead] == [
        (DEFAULT, "fp32"),
        (DEFAULT, "bf16"),
        ("trainer.clip_grad=1.0", "fp32"),
        ("trainer.clip_grad=1.0", "bf16"),
    ]
    for row in overhead:  # --repeats 2: two runs of one timed round each, pooled
        assert len(row["ratios"]) == 2 and all(map(_positive, row["ratios"]))
        assert row["run_medians"] == row["ratios"]  # each run's median of its one round
        assert all(map(_positive, row["amp_lab_ms"] + row["bare_ms"]))
        assert all(map(_positive, row["cpu_ratios"])) and len(row["cpu_ratios"]) == 2
        assert _positive(row["median_ratio"]) and _positive(row["median_cpu_ratio"])
    rows = data["throughput"]
    assert [(r["model"], r["precision"], r["compile"]) for r in rows] == [
        ("test_vit", "fp32", False),
        ("test_vit", "bf16", False),
    ]
    for row in rows:
        for key in [
            "first_step_s",
            "samples_per_s",
            "step_ms",
            "forward_ms",
            "backward_ms",
            "optimizer_ms",
            "peak_memory_mb",
            "flops_per_step",
            "achieved_tflops",
            "speedup_vs_fp32",
        ]:
            assert _positive(row[key]), key
        assert row["mfu"] is None  # no peak FLOPs on a CPU
        assert row["batch_size"] == 8 and row["img_size"] == 16
    assert rows[0]["speedup_vs_fp32"] == 1.0
    assert data["throughput_errors"] == []


@pytest.mark.slow
def test_bench_markdown_names_date_device_command_and_tables(tiny_bench):
    _, out = tiny_bench
    md = (out / "bench.md").read_text()
    env = json.loads((out / "bench.json").read_text())["environment"]
    assert env["date"] in md and env["device"] in md and f"`{env['command']}`" in md
    assert (
        "| model | variant | precision | amp_lab ms/step | bare ms/step | median ratio | min "
        "| max | CPU-time ratio | rounds | runs' median ratios |"
    ) in md
    assert "| test_vit | trainer.clip_grad=1.0 | bf16 |" in md
    assert (
        "| model | precision | compile | channels_last | batch | first step s | samples/s |"
    ) in md
    assert "| test_vit | bf16 | off | off | 8 |" in md
    # the real runs behind the overhead rows are ordinary run directories
    for run in ("overhead_test_vit_default_fp32", "overhead_test_vit_default_fp32_run2"):
        assert (out / "runs" / run / "summary.json").is_file()


@pytest.mark.slow
def test_the_gpu_check_script_runs_every_part_on_the_cpu(tmp_path):
    """DEVICE=cpu runs scripts/gpu_check.sh's own commands on a tiny ViT, as a dry run before
    GPU time is spent: every part finishes (trainer.compile=step included), the compiled rows
    load what compile_cache built, and gpu_check.md gathers every table. One mode (bf16, which
    the compile_step and fp8 parts use too) keeps it to one cold compile of the model."""
    out = tmp_path / "check"
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "DEVICE": "cpu",
        "MODELS": "test_vit",
        "MODES": "bf16",
        "STEP_MODEL": "test_vit",
        "FP8_MODELS": "test_vit",
        "FP8_BATCH_SIZE": "4",
        "BATCH_SIZE": "4",
        "IMG_SIZE": "16",
        "STEPS": "4",  # timed steps: enough to show each part runs, not to measure
        "WARMUP": "1",
        "OVERHEAD_STEPS": "2",
        "OVERRIDES": "+model.kwargs.depth=1",  # one block: the compiled parts compile faster
        "BUDGET_S": "1200",  # a busy 2-core CPU needs more than a GPU's 8 minutes
        "FEED_WORKERS": "0",
        "PEER_EPOCHS": "1",
        "PEER_SCRIPT": str(write_fake_peer(tmp_path)),
        "FAKE_PEER_RECORD": str(tmp_path / "peer_record.jsonl"),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
    }
    done = subprocess.run(
        [str(ROOT / "scripts" / "gpu_check.sh"), str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    parts = [
        "compile_cache",
        "no_sync",
        "images",
        "overhead",
        "throughput_compiled_test_vit",
        "compile_step",
        "feed",
        "peer",
        "fp8_0",
        "fp8_1",
        "throughput_eager",
        "overhead_full",
    ]
    status = dict(line.split(": ", 1) for line in (out / "status.txt").read_text().splitlines())
    assert sorted(status) == sorted(parts)
    failed = {part: outcome for part, outcome in status.items() if not outcome.startswith("rc=0 ")}
    assert not failed, f"{failed}; see the part's .log in {out}"

    def table(part: str, key: str) -> list[dict]:
        return json.loads((out / part / "bench.json").read_text())[key]

    assert [(r["precision"], r["error"]) for r in table("compile_cache", "compile_cache")] == [
        ("bf16", None)
    ]
    assert [(o["precision"], o["variant"]) for o in table("overhead", "overhead")] == [
        ("bf16", DEFAULT)
    ]
    assert [(o["precision"], o["variant"]) for o in table("overhead_full", "overhead")] == [
        ("bf16", "diagnostics=full")
    ]
    for part, compiled in [("throughput_eager", False), ("throughput_compiled_test_vit", True)]:
        rows = table(part, "throughput")
        assert [(r["precision"], r["compile"], r["batch_size"]) for r in rows] == [
            ("bf16", compiled, 4)
        ]
    fp8 = table("fp8_0", "throughput") + table("fp8_1", "throughput")
    assert [(r["precision"], r["fp8_recipe"], r["fp8_linears"] > 0) for r in fp8] == [
        ("bf16", None, False),
        ("fp8", "tensorwise", True),
        ("fp8", "rowwise", True),
    ]
    feed = table("feed", "feed")
    assert [r["data"] for r in feed] == [
        "synthetic",
        "imagefolder decode=cpu",
        "imagefolder decode=device",
    ]
    (peer,) = table("peer", "peer")
    assert [r["program"] for r in peer["runs"]] == ["peer", "amp_lab"] and peer["ratio"] > 0
    md = (out / "gpu_check.md").read_text()
    assert "- device: CPU" in md and 'MODES="bf16"' in md
    assert 'OVERRIDES="+model.kwargs.depth=1"' in md
    run = out / "overhead" / "runs" / "overhead_test_vit_default_bf16"
    kwargs = json.loads(json.loads((run / "settings.json").read_text())["model.kwargs"])
    assert kwargs == {"patch_size": 4, "depth": 1}  # OVERRIDES reached the runs
    assert "no-sync check: 4 skipped" in md  # the CUDA-only tests, on this CPU
    benchmarks = [part for part in parts if part not in ("no_sync", "images")]
    positions = [md.index(f"--out {out / part}`") for part in benchmarks]
    assert positions == sorted(positions)  # each benchmark's own markdown, in the order it ran
    # the compiled rows loaded what compile_cache built: inductor wrote no graph after it ended
    graphs = [
        p.stat().st_mtime for p in (tmp_path / "inductor").glob("fxgraph/**/*") if p.is_file()
    ]
    assert len(graphs) >= 2  # a forward and a backward graph
    compiled_end = (out / "throughput_compiled_test_vit" / "bench.json").stat().st_mtime
    assert (
        max(g for g in graphs if g < compiled_end)
        < (out / "compile_cache" / "bench.json").stat().st_mtime
    )


@pytest.mark.slow
def test_a_second_bench_into_the_same_folder_measures_again(tmp_path):
    for _ in range(2):
        code = bench.main(
            [
                *TINY,
                "--parts",
                "overhead",
                "--variants",
                "default",
                "--precisions",
                "fp32",
                "--out",
                str(tmp_path),
            ]
        )
        assert code == 0
        (row,) = json.loads((tmp_path / "bench.json").read_text())["overhead"]
        assert _positive(row["median_ratio"])


@pytest.mark.slow
def test_a_pure_16_bit_row_first_for_its_model_counts_its_flops(tmp_path):
    """The FLOPs are counted once per model, by its first row: here a bf16_pure model, which
    takes fp32 images only under its autocast."""
    code = bench.main(
        [
            *TINY,
            "--parts",
            "throughput",
            "--precisions",
            "bf16_pure",
            "fp32",
            "--out",
            str(tmp_path),
        ]
    )
    data = json.loads((tmp_path / "bench.json").read_text())
    assert code == 0 and data["throughput_errors"] == []
    first, fp32 = data["throughput"]
    assert (
        first["precision"] == "bf16_pure" and first["flops_per_step"] == fp32["flops_per_step"] > 0
    )


@pytest.mark.slow
def test_an_fp8_row_counts_the_linear_layers_torchao_converted(tmp_path):
    """test_vit's blocks hold 4 Linears each (qkv, proj, fc1, fc2), all 16-divisible; the head
    stays bf16. Emulated float8 on the CPU."""
    code = bench.main(
        [
            *TINY,
            "--parts",
            "throughput",
            "--precisions",
            "bf16",
            "fp8",
            "--override",
            "trainer.log_every=2",
            "data.num_classes=10",
            "precision.fp8_emulate=true",
            "precision.fp8_recipe=rowwise",
            "--out",
            str(tmp_path),
        ]
    )
    bf16, fp8 = json.loads((tmp_path / "bench.json").read_text())["throughput"]
    blocks = len(timm.create_model("test_vit", pretrained=False).blocks)
    assert code == 0 and (bf16["fp8_linears"], bf16["fp8_recipe"]) == (0, None)
    assert (fp8["fp8_linears"], fp8["fp8_recipe"]) == (4 * blocks, "rowwise")
    assert f"| {4 * blocks} (rowwise) |" in (tmp_path / "bench.md").read_text()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--variants", "diagnostics=nope"], "diagnostics"),
        (
            ["--steps", "3"],
            "multiple of trainer.log_every=2; use --steps 2 (or a multiple), or add "
            "--override trainer.log_every=3",
        ),
        (["--models", "test_vit", "nosuch"], "nosuch"),  # before test_vit is measured
        (["--device", "cuda"], "--device cuda but no CUDA GPU is visible; use --device cpu"),
    ],
)
def test_bad_bench_input_is_one_line_error(tmp_path, capsys, args, message):
    code = bench.main([*TINY, "--parts", "overhead", *args, "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1].startswith("amp_lab bench: error:") and message in err[-1]
    assert not (tmp_path / "bench.json").exists()  # failed before measuring anything


@pytest.mark.parametrize(
    "args, message",
    [
        (["--rounds", "0"], "--rounds"),
        (["--repeats", "0"], "--repeats"),
        (["--precisions", "fp64"], "--precisions: invalid choice: 'fp64'"),
    ],
)
def test_a_bad_argument_is_refused_in_one_line(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as stopped:
        bench.main([*TINY, "--parts", "overhead", *args, "--out", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and "error:" in err[-1] and message in err[-1]
    assert not (tmp_path / "bench.json").exists()


def test_default_variants_add_the_diagnostics_modes_the_default_is_not():
    # light is the default telemetry: measuring it twice would only cost time on a GPU lease
    assert bench.default_variants() == ["default", "diagnostics=full"]


def test_runnable_precisions_follow_the_mode_table():
    cpu = torch.device("cpu")
    runnable = bench.runnable_precisions(cpu)
    assert runnable == [name for name in PRECISION_MODES if name in runnable]  # table order
    assert {"fp32", "fp16", "fp16_noscale", "bf16"} <= set(runnable) and "tf32" not in runnable
    for name in set(PRECISION_MODES) - set(runnable):  # left out only when the device refuses
        with pytest.raises(ConfigError):
            resolve_precision(name, cpu)


def test_train_step_flops_count_forward_and_backward_matmuls():
    """A 2-layer MLP: fwd 2BIH + 2BHO; bwd 2BIH (no input grad) + 4BHO (weight + input grad)."""
    b, i, h, o = 4, 8, 16, 3
    model = torch.nn.Sequential(torch.nn.Linear(i, h), torch.nn.ReLU(), torch.nn.Linear(h, o))
    counted = flops.train_step_flops(model, torch.randn(b, i), torch.randint(0, o, (b,)))
    assert counted == 2 * b * i * h + 2 * b * h * o + 2 * b * i * h + 4 * b * h * o
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("name", ["test_vit", "test_convnext"])
def test_the_one_flop_counter_counts_what_torchs_own_counter_does(name):
    """The bench's step FLOPs come from the audit's per-module GEMM counter: on a real timm model,
    under autocast too, its total is torch.utils.flop_counter's."""
    from torch.utils.flop_counter import FlopCounterMode

    from amp_lab.components.loss import loss_fn

    model = timm.create_model(name, pretrained=False, num_classes=10)
    images, labels = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))
    with FlopCounterMode(display=False) as torchs:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(images)
        loss_fn(logits, labels).backward()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    assert flops.train_step_flops(model, images, labels, autocast) == torchs.get_total_flops() > 0


@pytest.mark.parametrize(
    "gpu, dtype, tflops",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
        ("NVIDIA H100 PCIe", "tf32", 378.0),
        ("NVIDIA H200", "fp16", 989.4),
        ("NVIDIA A100-SXM4-80GB", "fp32", 19.5),
        ("NVIDIA L4", "bf16", 121.0),
        ("NVIDIA L40S", "bf16", None),
        ("NVIDIA H100", "fp8", None),
    ],
)
def test_peak_flops_per_device_and_dtype(monkeypatch, gpu, dtype, tflops):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: gpu)
    peak = flops.peak_flops(torch.device("cuda"), dtype)
    assert peak == (tflops * 1e12 if tflops else None)
    assert flops.peak_flops(torch.device("cpu"), dtype) is None


def test_mfu_and_compute_dtype_of_each_mode():
    assert flops.mfu(10**12, 0.5, 4e12) == pytest.approx(0.5)
    assert flops.mfu(10**12, 0.5, None) is None
    dtypes = {name: mode.matmul_dtype for name, mode in PRECISION_MODES.items()}
    assert {k: dtypes[k] for k in ["fp32", "tf32", "fp16", "fp16_noscale", "bf16"]} == {
        "fp32": "fp32",
        "tf32": "tf32",
        "fp16": "fp16",
        "fp16_noscale": "fp16",
        "bf16": "bf16",
    }


def test_the_bare_loop_trains_the_runners_parameter_groups_on_its_own_copy(tmp_path):
    """Same optimizer both sides: the ratio measures the runner's machinery, not a second
    weight-decay group the bare loop would not have."""
    from amp_lab.build import build
    from amp_lab.tools.bench.overhead import BareLoop
    from amp_lab.trainer import Trainer

    trainer = Trainer(build(compose_settings(["model=test_convnext", "logger=disabled"]), tmp_path))
    runner_groups = trainer.run.optimizer.param_groups
    bare = BareLoop(trainer.run)
    groups = bare.optimizer.param_groups
    assert len(runner_groups) == len(groups) == 2  # timm: decay on weights, none on the rest
    copies = {id(p) for p in bare.model.parameters()}
    for runner, own in zip(runner_groups, groups, strict=True):
        assert own["weight_decay"] == runner["weight_decay"]
        assert [p.shape for p in own["params"]] == [p.shape for p in runner["params"]]
        assert all(id(p) in copies for p in own["params"])
    assert {g["weight_decay"] for g in groups} == {0.0, trainer.run.settings.optim.weight_decay}


@pytest.mark.slow
def test_the_overhead_measures_every_model_it_is_given(tmp_path):
    args = list(TINY)
    args[args.index("test_vit") + 1 : args.index("test_vit") + 1] = ["test_convnext"]
    args[args.index("--img-size") + 1] = "32"  # test_convnext's stem and stages need 32 px
    code = bench.main(
        [
            *args,
            "--parts",
            "overhead",
            "--precisions",
            "bf16",
            "--variants",
            "default",
            "--out",
            str(tmp_path),
        ]
    )
    assert code == 0
    rows = json.loads((tmp_path / "bench.json").read_text())["overhead"]
    assert [(r["model"], r["precision"]) for r in rows] == [
        ("test_vit", "bf16"),
        ("test_convnext", "bf16"),
    ]
    assert all(_positive(r["median_ratio"]) for r in rows)
    md = (tmp_path / "bench.md").read_text()
    assert f"| test_convnext | {DEFAULT} | bf16 |" in md
