"""optim.state_dtype: every state dtype trains, resumes to the bit and reports its memory; the
Adam second-moment cliff (fp16 moments zero out and inflate the step) measured."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from helpers import run_cli, settings
from helpers.distributed import torchrun
from helpers.host_reads import LOOP, watched_fit

from amp_lab.build import build
from amp_lab.components.optim import build_optimizer
from amp_lab.compose import compose_settings
from amp_lab.config import ConfigError
from amp_lab.diagnostics.optimizer_state import _zero_and_subnormal
from amp_lab.tools.bench import cli as bench
from amp_lab.tools.bench.runs import throughput_overrides
from amp_lab.tracking.sinks import Sink
from amp_lab.trainer import Trainer

DTYPES = ["fp32", "bf16", "fp16", "int8", "int4", "fp8"]
# docs/precision.md's figures for test_vit at 16 px (253,386 parameters)
DOCS_STATE_BYTES = {
    "fp32": 2_027_088,
    "bf16": 1_013_544,
    "int8": 609_360,
    "fp8": 560_208,
    "int4": 325_200,
}
# test_vit on 16x16 digits learns visibly in 60 steps at this LR (loss 2.30 at chance)
LEARN = [
    "trainer.max_steps=60",
    "trainer.batch_size=32",
    "trainer.log_every=10",
    "lr.base=3e-3",
    "lr.warmup_steps=5",
    "diagnostics.every=5",
]


def _rows(run_dir, kind="train"):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["kind"] == kind]


def _cliff_update(state_dtype: str, steps: int = 10) -> tuple[float, torch.Tensor]:
    """AdamW on a 128x64 layer whose gradients are ~1e-4 (squares ~1e-8, x (1 - beta2) below
    fp16's smallest subnormal): the mean |update| after `steps` and the second moment."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(128, 64, bias=False)  # 8192 values: torchao quantises it
    start = layer.weight.detach().clone()
    grad = torch.empty_like(start).uniform_(0.5e-4, 1.5e-4) * torch.randn_like(start).sign()
    cfg = settings(f"optim.state_dtype={state_dtype}", "optim.weight_decay=0").optim
    optimizer = build_optimizer(layer, cfg, lr=1e-3)
    for _ in range(steps):
        layer.weight.grad = grad.clone()
        optimizer.step()
    update = (layer.weight.detach() - start).abs().mean().item()
    return update, optimizer.state[layer.weight]["exp_avg_sq"]


@pytest.mark.slow
def test_fp16_second_moment_zeroes_out_and_inflates_the_step_others_match_fp32():
    reference, v32 = _cliff_update("fp32")
    assert reference == pytest.approx(1e-2, rel=1e-3)  # Adam: ~lr per step, 10 steps
    assert _zero_and_subnormal(v32).tolist() == [0, 0]
    update, v16 = _cliff_update("fp16")
    assert v16.dtype == torch.float16 and _zero_and_subnormal(v16).tolist() == [v16.numel(), 0]
    assert update > 1000 * reference  # lr * m / eps instead of lr * m / sqrt(v)
    for dtype in ["bf16", "int8", "int4", "fp8"]:
        update, v = _cliff_update(dtype)
        assert _zero_and_subnormal(v).tolist() == [0, 0], dtype
        assert update == pytest.approx(reference, rel=0.02), dtype


@pytest.mark.slow
@pytest.mark.parametrize("state_dtype", [d for d in DTYPES if d != "fp16"])
def test_every_state_dtype_trains_a_vit_and_reports_its_memory(state_dtype, tmp_path):
    trainer = Trainer(build(settings(f"optim.state_dtype={state_dtype}", *LEARN), tmp_path))
    summary = trainer.fit()
    params = summary["params"]
    assert summary["status"] == "completed" and summary["optimizer_state_dtype"] == state_dtype
    assert summary["master_weight_bytes"] == 0  # fp32 weights: the optimizer steps them
    train = _rows(tmp_path)
    assert train[-1]["train/loss"] < train[0]["train/loss"] - 0.05  # it learns
    assert summary["final_val_loss"] < 2.3
    assert all(r["diag/v_zero_share"] < 0.01 and r["diag/max_update_ratio"] < 0.1 for r in train)
    state_bytes = summary["optimizer_state_bytes"]
    assert state_bytes == DOCS_STATE_BYTES[state_dtype]
    moments = [s["exp_avg_sq"] for s in trainer.run.optimizer.state.values()]
    expected = {"fp32": 8 * params, "bf16": 4 * params}
    if state_dtype in expected:
        assert state_bytes == expected[state_dtype]
        assert {m.dtype for m in moments} == {
            torch.float32 if state_dtype == "fp32" else torch.bfloat16
        }
    else:  # torchao: big tensors block-quantised, the small ones (< 4096 values) in fp32
        kind = {"int8": "OptimState8bit", "int4": "OptimState4bit", "fp8": "OptimStateFp8"}
        assert kind[state_dtype] in {type(m).__name__ for m in moments}
        ceiling = {"int8": 0.31, "fp8": 0.31, "int4": 0.2}[state_dtype]
        assert state_bytes < ceiling * 8 * params


def test_fp16_moments_break_a_short_run_that_fp32_moments_train(tmp_path):
    """The cliff on a real run: most of the fp16 second moment is 0 or subnormal after one
    step, the next step is thousands of times the weight, and the loss goes non-finite."""
    probes = [
        "trainer.max_steps=6",
        "trainer.batch_size=32",
        "trainer.log_every=1",
        "lr.base=3e-3",
        "lr.warmup_steps=5",
        "diagnostics.every=1",
    ]
    runs = {}
    for dtype in ["fp32", "fp16"]:
        summary = Trainer(
            build(settings(f"optim.state_dtype={dtype}", *probes), tmp_path / dtype)
        ).fit()
        runs[dtype] = (summary, _rows(tmp_path / dtype))
    summary, rows = runs["fp32"]
    assert summary["skipped_steps"] == 0 and all(math.isfinite(r["train/loss"]) for r in rows)
    # fp32 moments hold no underflow: a zero only where a gradient element is exactly zero
    # (one of test_vit's ~127k on an AMD EPYC CPU)
    assert all(r["diag/v_zero_share"] < 1e-4 for r in rows)
    assert max(r["diag/max_update_ratio"] for r in rows) < 0.1
    summary, rows = runs["fp16"]
    assert rows[0]["diag/v_zero_share"] + rows[0]["diag/v_subnormal_share"] > 0.9
    assert rows[0]["diag/v_zero_share"] > 0.8  # docs/precision.md: 85.8% exactly 0
    assert rows[1]["diag/max_update_ratio"] > 100  # lr * m / eps
    assert not math.isfinite(rows[4]["train/loss"])  # the docs' "nan at step 5"
    assert summary["skipped_steps"] > 0 and not math.isfinite(summary["final_val_loss"])


def test_bf16_stochastic_rounding_is_unbiased_where_nearest_stalls():
    """A first moment that grows by 1/1000 of (1 - itself) per step: past 0.25 the growth is
    under half a bf16 spacing (2**-9), so nearest rounding stalls there; stochastic rounding
    follows the fp32 value on average."""
    results = {}
    for rounding in ["nearest", "stochastic"]:
        torch.manual_seed(0)
        layer = torch.nn.Linear(4096, 1, bias=False)
        cfg = settings(
            "optim.state_dtype=bf16",
            f"optim.state_rounding={rounding}",
            "optim.weight_decay=0",
            "+optim.kwargs.betas=[0.999,0.999]",
        ).optim
        optimizer = build_optimizer(layer, cfg, lr=1e-9)
        for _ in range(500):
            layer.weight.grad = torch.ones_like(layer.weight)
            optimizer.step()
        results[rounding] = optimizer.state[layer.weight]["exp_avg"].float().mean().item()
    exact = 1 - 0.999**500  # the fp32 first moment after 500 steps of gradient 1: 0.394
    assert results["stochastic"] == pytest.approx(exact, rel=0.01)
    assert results["nearest"] == pytest.approx(0.25, abs=2**-9)


class StopAt(Sink):
    """Ends the run (no clean exit) once the records of `step` are written."""

    def __init__(self, step: int) -> None:
        self.step = step

    def log(self, record: dict) -> None:
        if record["step"] == self.step:
            raise KeyboardInterrupt


@pytest.mark.slow
@pytest.mark.parametrize("state_dtype", ["bf16", "int8", "int4", "fp8"])
def test_low_precision_state_resumes_to_the_bit(state_dtype, tmp_path):
    run = [
        f"optim.state_dtype={state_dtype}",
        "trainer.max_steps=6",
        "trainer.log_every=1",
        "checkpoint.every_steps=3",
        "checkpoint.every_minutes=0",
        *(["optim.state_rounding=stochastic"] if state_dtype == "bf16" else []),
    ]
    whole = Trainer(build(settings(*run), tmp_path / "whole"))
    whole.fit()
    with pytest.raises(KeyboardInterrupt):
        Trainer(build(settings(*run), tmp_path / "split"), [StopAt(4)]).fit()
    [path] = (tmp_path / "split" / "checkpoints").glob("step_*.pt")
    saved = torch.load(path, weights_only=True)["parts"]["optimizer"]["state"]
    kinds = {type(s["exp_avg_sq"]).__name__ for s in saved.values()}
    assert (
        kinds == {"Tensor"}
        if state_dtype == "bf16"
        else any(k.startswith("OptimState") for k in kinds)
    )  # torchao's subclasses, loaded weights_only
    resumed = Trainer(build(settings(*run), tmp_path / "split"))
    assert resumed.run.state.step == 3
    resumed.fit()
    for a, b in zip(whole.run.model.parameters(), resumed.run.model.parameters()):
        assert torch.equal(a, b)
    for p_whole, p_resumed in zip(
        whole.run.optimizer.state.values(), resumed.run.optimizer.state.values()
    ):
        for key in ("exp_avg", "exp_avg_sq"):
            a, b = p_whole[key], p_resumed[key]
            assert type(a) is type(b) and a.dtype == b.dtype
            assert torch.equal(
                a.dequantize() if hasattr(a, "dequantize") else a,
                b.dequantize() if hasattr(b, "dequantize") else b,
            )


# in a fresh process: whether each checkpoint loads weights_only, before and after torchao.optim
LOADS = """
import json, pickle, sys, torch

def loads(path):
    try:
        torch.load(path, weights_only=True)
    except pickle.UnpicklingError:  # a class not marked safe
        return False
    return True

before = [loads(path) for path in sys.argv[1:]]
import torchao.optim
print(json.dumps({"before": before, "after": [loads(path) for path in sys.argv[1:]]}))
"""


@pytest.mark.slow
def test_a_low_bit_checkpoint_loads_weights_only_once_torchao_optim_is_imported(tmp_path):
    """What docs/precision.md says: torchao marks its state classes safe for torch.load when
    torchao.optim is imported, so a script reading such a checkpoint imports it first."""
    paths = []
    for state_dtype in ["int8", "int4", "fp8"]:
        run = [
            f"optim.state_dtype={state_dtype}",
            "trainer.max_steps=2",  # a periodic checkpoint at step 1 (none at the last step)
            "checkpoint.every_steps=1",
            "checkpoint.every_minutes=0",
        ]
        Trainer(build(settings(*run), tmp_path / state_dtype)).fit()
        [path] = (tmp_path / state_dtype / "checkpoints").glob("step_*.pt")
        paths.append(str(path))
    done = subprocess.run(
        [sys.executable, "-c", LOADS, *paths], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout) == {"before": [False] * 3, "after": [True] * 3}


@pytest.mark.slow
@pytest.mark.parametrize("master_weights", ["true", "false"])
def test_low_bit_state_with_bf16_weights(master_weights, tmp_path):
    summary = Trainer(
        build(
            settings(
                "precision=bf16_pure",
                f"precision.master_weights={master_weights}",
                "optim.state_dtype=int8",
                *LEARN,
            ),
            tmp_path,
        )
    ).fit()
    assert summary["status"] == "completed"
    train = _rows(tmp_path)
    assert train[-1]["train/loss"] < train[0]["train/loss"] - 0.05
    assert all(r["diag/v_zero_share"] < 0.01 for r in train)  # probed on the masters' state
    masters = summary["master_weight_bytes"]
    assert masters == (4 * summary["params"] if master_weights == "true" else 0)
    assert summary["diagnostics"]["fp32_state_ok"] is True  # chosen, not the half_model mistake


def test_a_chosen_state_dtype_is_not_the_half_model_pitfall(tmp_path):
    chosen = Trainer(
        build(settings("optim.state_dtype=bf16", "trainer.max_steps=2"), tmp_path / "a")
    )
    assert chosen.fit()["diagnostics"]["fp32_state_ok"] is True
    accident = Trainer(
        build(
            settings("pitfall=half_model", "precision=fp16", "trainer.max_steps=2"), tmp_path / "b"
        )
    ).fit()
    assert accident["diagnostics"]["fp32_state_ok"] is False
    assert accident["optimizer_state_dtype"] == "fp16"
    assert "half_model" in accident["diagnostics"]["signatures"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["optim.state_dtype=int3"], "optim.state_dtype='int3' is unknown; use one of"),
        (
            ["optim=sgd", "optim.state_dtype=int4"],
            "optim.state_dtype=int4 exists for ('adamw', 'adam') only, not optim.name=sgd",
        ),
        (
            ["optim.state_dtype=fp16", "optim.state_rounding=stochastic"],
            "optim.state_rounding=stochastic exists for optim.state_dtype=bf16 only",
        ),
        (["optim.block_size=64"], "optim.block_size applies to state_dtype int8, int4 or fp8"),
        (["optim.state_dtype=int8", "optim.fused=true"], "optim.fused=true has no kernel"),
    ],
)
def test_bad_state_settings_are_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        settings(*overrides)
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_cli_refuses_bad_state_settings_with_exit_2(tmp_path):
    for overrides, message in [
        (["optim.state_dtype=int3"], "optim.state_dtype='int3' is unknown; use one of"),
        (
            ["optim=sgd", "optim.state_dtype=int4"],
            "optim.state_dtype=int4 exists for ('adamw', 'adam') only",
        ),
    ]:
        done = run_cli(*overrides, "hydra.run.dir=run", cwd=tmp_path)
        assert done.returncode == 2 and message in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert not (tmp_path / "run" / "summary.json").exists()


def test_block_size_reaches_torchao(tmp_path):
    trainer = Trainer(
        build(
            settings("optim.state_dtype=int8", "optim.block_size=128", "trainer.max_steps=1"),
            tmp_path,
        )
    )
    trainer.fit()
    blocks = {
        s["exp_avg_sq"].block_size
        for s in trainer.run.optimizer.state.values()
        if hasattr(s["exp_avg_sq"], "block_size")
    }
    assert blocks == {128}


@pytest.mark.slow
def test_bench_throughput_table_shows_the_state_memory(tmp_path):
    rows = {}
    for state_dtype in ["fp32", "int8"]:
        args = [
            "--parts",
            "throughput",
            "--models",
            "test_vit",
            "--precisions",
            "fp32",
            "--img-size",
            "16",
            "--batch-size",
            "8",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--device",
            "cpu",
            "--out",
            str(tmp_path / state_dtype),
            "--override",
            f"optim.state_dtype={state_dtype}",
            "data.num_classes=10",
        ]
        assert bench.main(args) == 0
        [rows[state_dtype]] = json.loads((tmp_path / state_dtype / "bench.json").read_text())[
            "throughput"
        ]
        table = (tmp_path / state_dtype / "bench.md").read_text()
        assert f"| {state_dtype} | {rows[state_dtype]['state_mb']:.2f} |" in table
    built = Trainer(
        build(
            compose_settings(
                throughput_overrides(bench.parse_args(args), "test_vit", "fp32", False)
            ),
            tmp_path / "count",
        )
    )
    fp32_mb = 8 * sum(p.numel() for p in built.run.model.parameters()) / 2**20
    assert rows["fp32"]["state_mb"] == pytest.approx(fp32_mb)
    assert 0.1 * fp32_mb < rows["int8"]["state_mb"] < 0.31 * fp32_mb


@pytest.mark.slow
def test_int8_state_under_ddp_matches_one_process(tmp_path):
    """Two gloo ranks with half the batch each step exactly as one process with the whole."""
    common = [
        "model=test_vit",
        "data.img_size=16",
        "trainer.max_steps=4",
        "trainer.log_every=2",
        "trainer.progress=false",
        "trainer.device=cpu",
        "logger.mode=disabled",
        "optim.state_dtype=int8",
    ]
    launched = torchrun(
        *common, "trainer.strategy=ddp", "trainer.batch_size=8", "hydra.run.dir=ddp", cwd=tmp_path
    )
    assert launched.returncode == 0, launched.stderr[-3000:]
    # the one-process reference in this process
    Trainer(build(settings(*common, "trainer.batch_size=16"), tmp_path / "one")).fit()
    runs = ["ddp", "one"]
    ddp, one = (json.loads((tmp_path / n / "summary.json").read_text()) for n in runs)
    assert ddp["world_size"] == 2 and ddp["optimizer_state_dtype"] == "int8"
    assert ddp["optimizer_state_bytes"] == one["optimizer_state_bytes"]  # per rank: all of it
    losses = [[r["train/loss"] for r in _rows(tmp_path / n)] for n in runs]
    assert losses[0] == pytest.approx(losses[1], rel=1e-4)


def test_bf16_state_steps_without_host_reads_and_skips_an_inf_step_on_the_device(
    monkeypatch, tmp_path
):
    """GradScaler hands its inf flag to the step (no `.item()` per step); the step with an inf
    gradient changes neither weights nor moments nor the step count."""
    run = ["optim.state_dtype=bf16", "optim.state_rounding=stochastic"]
    trainer = Trainer(build(settings(*run, *LOOP, "fault.inf_grad_at_step=2"), tmp_path / "inf"))
    watch = watched_fit(monkeypatch, trainer)
    assert watch.calls == [], watch.calls[0]
    assert _rows(tmp_path / "inf")[0]["amp/skipped_steps"] == 1
    monkeypatch.undo()
    runs = {}
    for name, extra in [
        ("one", ["trainer.max_steps=1"]),
        ("skip", ["trainer.max_steps=2", "fault.inf_grad_at_step=2"]),
    ]:
        runs[name] = Trainer(build(settings(*run, "lr.schedule=constant", *extra), tmp_path / name))
        runs[name].fit()
    for a, b in zip(runs["one"].run.model.parameters(), runs["skip"].run.model.parameters()):
        assert torch.equal(a, b)
    for a, b in zip(
        runs["one"].run.optimizer.state.values(), runs["skip"].run.optimizer.state.values()
    ):
        assert a["step"] == b["step"] == 1
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(
            a["exp_avg_sq"], b["exp_avg_sq"]
        )


def test_torchao_states_read_the_inf_flag_on_the_host_each_step(monkeypatch, tmp_path):
    """What docs/precision.md says: torchao's low-bit optimizers take no on-device inf flag, so
    GradScaler reads it on the host before each of their steps (not only at state creation)."""
    trainer = Trainer(build(settings("optim.state_dtype=int8", *LOOP), tmp_path))
    watch = watched_fit(monkeypatch, trainer)
    # one inf-flag read in each of the 5 steps (the step itself is never inside a log record)
    assert len([call for call in watch.calls if "_maybe_opt_step" in call]) == 5


@pytest.mark.parametrize(
    ("name", "state_dtype", "expected"),
    [
        ("adamw", "int8", "AdamW8bit"),
        ("adamw", "int4", "AdamW4bit"),
        ("adamw", "fp8", "AdamWFp8"),
        ("adam", "int8", "Adam8bit"),
        ("adam", "int4", "Adam4bit"),
        ("adam", "fp8", "AdamFp8"),
        ("adamw", "bf16", "LowPrecisionMomentsAdam"),
        ("adam", "fp16", "LowPrecisionMomentsAdam"),
    ],
)
def test_the_state_dtype_table(name, state_dtype, expected):
    cfg = settings(f"optim.name={name}", f"optim.state_dtype={state_dtype}").optim
    optimizer = build_optimizer(torch.nn.Linear(64, 64), cfg, lr=1e-3)
    assert type(optimizer).__name__ == expected
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.0, 0.05]  # bias, weight
    if expected == "LowPrecisionMomentsAdam":
        assert optimizer.decoupled is (name == "adamw")
