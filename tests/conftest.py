"""Fixtures and hooks only; what the tests share otherwise lives in tests/helpers/."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator

import pytest
import torch
from helpers import FAST
from helpers.slurm import SCRIPT


def pytest_configure(config: pytest.Config) -> None:
    # One torch thread per process: on 2 shared cores a tiny model runs several times faster
    # than with threads fighting over them; subprocesses (CLI runs, SLURM jobs) inherit it.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)


@pytest.fixture
def fast_overrides() -> list[str]:
    return list(FAST)


@pytest.fixture
def ctrl_c() -> Iterator[None]:
    """Ctrl-C reaches Python as on a terminal, also when pytest was started with SIGINT ignored
    (a background job of a shell without job control), which the runner rightly leaves alone."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    """The test SLURM cluster, started (and stopped after the module) when it is not up."""
    started = subprocess.run([str(SCRIPT), "status"], capture_output=True).returncode != 0
    if started:
        subprocess.run([str(SCRIPT), "start"], check=True, timeout=900)
    yield
    if started:
        subprocess.run([str(SCRIPT), "stop"], check=True, timeout=120)
