"""torchao, the optional extra: imported without torch's deprecation line, or refused in one."""

from __future__ import annotations

import sys

import pytest
from helpers import run_cli

from amp_lab.config import ConfigError
from amp_lab.precision.torchao_extra import import_torchao


def test_a_float8_audit_shows_its_findings_and_no_line_from_torchs_pytree(tmp_path):
    result = run_cli(
        *("audit", "precision=fp8", "precision.fp8_emulate=true", "model=test_vit"),
        *("data.img_size=16", "trainer.batch_size=8", "trainer.device=cpu"),
        *("--out", str(tmp_path)),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("fp8: ")
    # torchao's import made this torch log "... is an Enum subclass ... register_constant()"
    assert "register_constant" not in result.stderr and "Enum subclass" not in result.stderr


def test_a_missing_torchao_is_one_line_naming_the_setting_and_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.optim", None)  # as if the extra were absent
    with pytest.raises(ConfigError) as err:
        import_torchao("torchao.optim", "optim.state_dtype=int8", "amp-lab[optim]")
    assert str(err.value).startswith("optim.state_dtype=int8 needs torchao (")
    assert str(err.value).endswith("): pip install 'amp-lab[optim]'")
