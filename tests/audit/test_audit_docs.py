"""docs/precision.md's table of promises is what the code promises."""

from __future__ import annotations

import torch
from helpers import ROOT

from amp_lab.choices import PrecisionName
from amp_lab.config import PrecisionConfig, ScalerConfig
from amp_lab.precision.modes import PRECISION_MODES, PrecisionPolicy
from amp_lab.precision.scaling import uses_dynamic_scaling


def test_the_docs_table_of_promises_is_each_modes_promise():
    text = (ROOT / "docs" / "precision.md").read_text()
    rows = [line.strip("|").split("|") for line in text.splitlines() if line.startswith("| ")]
    table = {
        r[0].strip(): [c.strip() for c in r[1:]] for r in rows if r[0].strip() in PRECISION_MODES
    }
    assert set(table) == set(PRECISION_MODES)
    for name, mode in PRECISION_MODES.items():
        policy = PrecisionPolicy(
            mode, torch.device("cpu"), PrecisionConfig(name=PrecisionName(name))
        )
        p = policy.promise("fp32", uses_dynamic_scaling(ScalerConfig(), policy))
        scaler = "yes" if p.scaler else "no"
        assert table[name] == [p.compute, p.params, p.masters, p.state, p.loss, scaler], name
