"""`amp_lab numerics --vs compiled`: a compiled step that computes wider than labelled, or turns
non-finite where eager does not, is flagged. The compilers are torch.compile backends registered
here, run through the real command (trainer.compile=model, trainer.compile_backend=NAME)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator

import pytest
import torch
from helpers import FAST

from amp_lab.tools.numerics.cli import NUMERICS_FILE, main


def _backend(name: str, wrap: Callable[[Callable], Callable]) -> str:
    """Register a torch.compile backend that runs dynamo's graph through `wrap`."""

    def compiler(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        return wrap(gm.forward)

    torch._dynamo.register_backend(compiler_fn=compiler, name=name)
    return name


def _upcast(graph: Callable) -> Callable:
    """The graph in fp32 whatever autocast says: inductor keeping a bf16 chain in fp32."""

    def run(*args):
        with torch.autocast("cpu", enabled=False):
            return graph(*args)

    return run


def _nan_logits(graph: Callable) -> Callable:
    """The graph with a NaN in its first output: a compiled kernel's NaN eager never shows."""

    def run(*args):
        out = list(graph(*args))
        out[0] = out[0] * torch.where(torch.arange(out[0].numel()) == 0, math.nan, 1.0).view_as(
            out[0]
        )
        return out

    return run


def _zeros_for_nan(graph: Callable) -> Callable:
    """The graph with non-finite outputs read as zeros: compiled fp16 var+rsqrt giving zeros
    where eager gives NaN (pytorch #183605)."""

    def run(*args):
        return [torch.nan_to_num(o, 0.0, 0.0, 0.0) for o in graph(*args)]

    return run


UPCAST = _backend("amp_lab_test_upcast", _upcast)
NAN = _backend("amp_lab_test_nan", _nan_logits)
ZEROS = _backend("amp_lab_test_zeros", _zeros_for_nan)


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()  # each test compiles with its own backend
    yield
    torch._dynamo.reset()


def _compare(tmp_path, backend: str, *more: str) -> tuple[int, dict]:
    code = main(
        [
            *FAST,
            "precision=bf16",
            *more,
            f"trainer.compile_backend={backend}",
            "--vs",
            "compiled",
            "--out",
            str(tmp_path),
        ]
    )
    return code, json.loads((tmp_path / NUMERICS_FILE).read_text())


def test_a_compiled_step_that_computes_wider_than_labelled_is_flagged(tmp_path, capsys):
    code, found = _compare(tmp_path, UPCAST)
    assert code == 1
    kinds = [f["kind"] for f in found["compiled_flags"]]
    assert kinds == ["computed wider than labelled"]
    upcast = found["compiled_flags"][0]
    assert upcast["compiled_error"] < 0.01 * upcast["eager_error"]  # fp32 against fp32
    assert set(found["modes"]) == {"bf16", "bf16 compiled"}
    assert "compiled: computed wider than labelled (logits)" in capsys.readouterr().out


def test_a_nan_only_the_compiled_step_makes_is_flagged(tmp_path):
    code, found = _compare(tmp_path, NAN)
    assert code == 1
    flags = {f["kind"]: f for f in found["compiled_flags"]}
    assert flags["non-finite in compiled only"]["where"] == "logits"
    assert "non-finite in eager only" not in flags
    assert found["modes"]["bf16"]["output"]["logits_nonfinite"] == 0.0


def test_a_nan_only_eager_makes_is_flagged(tmp_path):
    code, found = _compare(
        tmp_path,
        ZEROS,
        "precision=fp16",
        "fault.overflow_module=blocks.0.norm1",
        "fault.overflow_factor=1e6",
    )
    assert code == 1
    flags = {f["kind"]: f for f in found["compiled_flags"]}
    assert flags["non-finite in eager only"]["where"] == "logits"
    assert found["modes"]["fp16 compiled"]["output"]["logits_nonfinite"] == 0.0
