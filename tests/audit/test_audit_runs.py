"""The audit where a user meets it: `amp_lab audit` alone, a training run's stop line and exit
code, a resumed run's audit, a compiled model's audit."""

from __future__ import annotations

import json

import pytest
from helpers import FAST, run_cli, settings
from helpers.resume import interrupt

from amp_lab.build import build
from amp_lab.records import AUDIT_FILE
from amp_lab.tools.audit import main
from amp_lab.trainer import Trainer

# every comparison of two audits: what ran, not when
SAME = ("promise", "kept", "breaches", "headline", "coverage", "modules", "params", "loss", "fp8")


def test_amp_lab_audit_runs_one_step_alone_and_prints_the_headline(tmp_path):
    done = run_cli(
        "audit",
        *FAST,
        "precision=bf16",
        "precision.fp32_modules=[head]",
        "--out",
        str(tmp_path),
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[:2] == [  # as docs/precision.md shows it
        "bf16: >99.9% of GEMM FLOPs in bf16; fp32: head (<0.1%, fp32_modules)",
        "promise: compute bf16, params fp32, masters fp32, state fp32, loss fp32, scaler False",
    ]
    assert f"details: {tmp_path / AUDIT_FILE}" in done.stdout
    assert json.loads((tmp_path / AUDIT_FILE).read_text())["kept"] is True
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "summary.json").exists()


def test_amp_lab_audit_says_each_breach_of_a_pitfall_run_once(tmp_path):
    """audit=warn (a pitfall run): the tool prints every breach, and the run's own warnings of
    them stay silent."""
    done = run_cli("audit", *FAST, "precision=fp16", "pitfall=half_model", cwd=tmp_path)
    breaches = [line for line in done.stdout.splitlines() if line.startswith("broken: ")]
    assert done.returncode == 2 and len(breaches) >= 2, done.stderr[-2000:]
    for line in breaches:
        assert (done.stdout + done.stderr).count(line.removeprefix("broken: ")) == 1, line


def test_amp_lab_audit_of_a_broken_promise_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    import amp_lab.build

    monkeypatch.setattr(amp_lab.build, "keep_in_fp32", lambda net, patterns, device: [])
    code = main([*FAST, "precision=bf16", "precision.fp32_modules=[head]", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith(
        "amp_lab: error: precision audit: precision.fp32_modules promises fp32 GEMMs in head, "
        "but they ran in bf16"
    )


def test_a_training_run_that_breaks_its_promise_exits_2_with_one_line(
    tmp_path, monkeypatch, capsys
):
    import amp_lab.build
    from amp_lab.__main__ import cli

    monkeypatch.setattr(amp_lab.build, "keep_in_fp32", lambda net, patterns, device: [])
    args = [*FAST, "precision=bf16", "precision.fp32_modules=[head]", f"hydra.run.dir={tmp_path}"]
    monkeypatch.setattr("sys.argv", ["amp_lab", *args])
    with pytest.raises(SystemExit) as stopped:
        cli()
    err = capsys.readouterr().err.strip().splitlines()
    assert stopped.value.code == 2 and len(err) == 1
    assert err[0].startswith("amp_lab: error: precision audit: precision.fp32_modules promises")
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 0 and summary["status"].startswith("stopped: precision audit")


@pytest.mark.parametrize("model", ["test_vit", "test_convnext"])
def test_a_model_cast_behind_the_runs_back_stops_before_its_first_step(
    tmp_path, monkeypatch, model
):
    """A sitecustomize casts every timm model to fp16 under precision=bf16: the run stops before
    its first step with one line naming the modules and the promise, not torch's traceback
    from inside autocast ('Unexpected floating ScalarType')."""
    (tmp_path / "sitecustomize.py").write_text(
        "import timm\n"
        "create = timm.create_model\n"
        "timm.create_model = lambda *args, **kwargs: create(*args, **kwargs).half()\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    args = [*FAST, f"model={model}", "data.img_size=32", "precision=bf16", "hydra.run.dir=run"]
    done = run_cli(*args, cwd=tmp_path)
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(err) == 1, done.stderr[-2000:]
    assert err[0].startswith(
        "amp_lab: error: precision audit, before the first step: precision=bf16 promises fp32 "
        "weights, but those of "
    ), err[0]
    assert err[0].endswith(
        "are fp16 (and 2 more: precision_audit.json); audit=warn trains on regardless"
    ), err[0]  # the other 2: both param groups' fp16 masters (no optimizer state before a step)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 0 and summary["status"].startswith("stopped: precision audit")


def test_a_pitfall_run_breaks_its_promise_on_purpose_and_trains_on(tmp_path):
    """pitfall=half_model: fp16 weights and optimizer, no scaler. Audited, warned, trained."""
    summary = Trainer(build(settings("precision=fp16", "pitfall=half_model"), tmp_path)).fit()
    lines = [b["line"] for b in json.loads((tmp_path / AUDIT_FILE).read_text())["breaches"]]
    assert lines[0].startswith("precision=fp16 promises fp32 weights, but those of (model), ")
    assert (
        "precision=fp16 promises a dynamic loss scaler, but the loss was not scaled " in lines[-1]
    )
    assert summary["status"] == "completed" and summary["precision_audit"]["kept"] is False


@pytest.mark.slow
def test_a_resumed_run_audits_its_first_step_as_the_uninterrupted_run_did(tmp_path):
    run = [
        "precision=fp16",
        "trainer.max_steps=4",
        "trainer.log_every=1",
        "checkpoint.every_minutes=0",
    ]
    interrupt(tmp_path / "resumed", run, at_step=2)
    first = json.loads((tmp_path / "resumed" / AUDIT_FILE).read_text())
    Trainer(build(settings(*run), tmp_path / "resumed")).fit()
    resumed = json.loads((tmp_path / "resumed" / AUDIT_FILE).read_text())
    assert (first["step"], resumed["step"]) == (1, 3) and resumed["resumed"] is True
    assert {k: resumed[k] for k in SAME} == {k: first[k] for k in SAME}
    assert resumed["optimizer"] == first["optimizer"]


@pytest.mark.slow
def test_eager_and_a_compiled_model_give_the_same_audit(tmp_path):
    """The dispatch mode keeps Dynamo from tracing the audited step: it runs eagerly (the model
    compiles at the second step), so what the audit sees is the graph's eager semantics."""
    audits = {}
    for name, extra in [("eager", []), ("compiled", ["trainer.compile=model"])]:
        trainer = Trainer(
            build(
                settings(
                    "precision=bf16",
                    "trainer.max_steps=2",
                    "trainer.compile_backend=aot_eager",
                    *extra,
                ),
                tmp_path / name,
            )
        )
        trainer.fit()
        audits[name] = json.loads((tmp_path / name / AUDIT_FILE).read_text())
    assert audits["compiled"]["compile"] == {
        "mode": "model",
        "backend": "aot_eager",
        "compiled": True,
    }
    assert {k: audits["compiled"][k] for k in SAME} == {k: audits["eager"][k] for k in SAME}


def test_the_report_shows_low_precision_flops_and_flags_broken_promises(tmp_path):
    from helpers.reports import report, run

    sweep = tmp_path / "sweep"
    run(sweep, "0_pitfall=none", "precision=fp16", "precision.fp32_modules=[head]", steps=2)
    run(sweep, "1_pitfall=half_model", "precision=fp16", "pitfall=half_model", steps=2)
    data = report(str(sweep), "--by", "pitfall.name")
    cells = {c["value"]: c for g in data["groups"] for c in g["cells"]}
    share = cells["none"]["figures"]["low_precision_share"]["mean"]
    assert 0.999 < share < 1  # all but the fp32 head
    assert not cells["none"]["health"]
    audit = [h for h in cells["half_model"]["health"] if h.startswith("precision audit")]
    assert audit[0].startswith(
        "precision audit: precision=fp16 promises fp32 weights, but those of (model), "
    )
    table = (sweep / "report" / "report.md").read_text()
    header = next(line for line in table.splitlines() if line.startswith("| pitfall.name"))
    assert "| low-precision FLOPs % |" in header
    assert "precision audit: precision=fp16 promises fp32 weights" in table


@pytest.mark.slow
def test_under_fsdp_the_audit_reports_each_units_policy(tmp_path):
    """Two gloo ranks: the root and test_vit's 6 blocks are units, each gathering its fp32
    shards in bf16 for compute and reducing gradients in fp32 (fsdp's auto dtypes under bf16)."""
    from helpers.distributed import torchrun

    done = torchrun(
        *FAST,
        "trainer.max_steps=2",
        "trainer.strategy=fsdp",
        "precision=bf16",
        "hydra.run.dir=run",
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    audit = json.loads((tmp_path / "run" / AUDIT_FILE).read_text())
    assert audit["kept"] and audit["headline"] == "bf16: 100.0% of GEMM FLOPs in bf16"
    assert [u["unit"] for u in audit["fsdp"]] == ["(root)", *(f"blocks.{i}" for i in range(6))]
    assert all(
        (u["param_dtype"], u["reduce_dtype"], u["computed_with"]) == ("bf16", "fp32", ["bf16"])
        for u in audit["fsdp"]
    )
    assert audit["modules"]["blocks.0.attn.qkv"]["params"] == "bf16"  # gathered in bf16
    assert audit["params"]["blocks.0.attn.qkv.weight"]["dtype"] == "fp32"  # the shard kept fp32
