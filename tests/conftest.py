"""Fixtures and hooks only; what the tests share otherwise lives in tests/helpers/."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import FAST
from helpers.slurm import cluster_conf, why_not_up


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--require-slurm",
        action="store_true",
        help="fail, not skip, the tests that need the test SLURM cluster when it is not up (CI)",
    )


def pytest_configure(config: pytest.Config) -> None:
    # One torch thread per process: on 2 shared cores a tiny model runs several times faster
    # than with threads fighting over them; subprocesses (CLI runs, SLURM jobs) inherit it.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    # Every SLURM command a test or its subprocesses run reads the test cluster's slurm.conf, or an
    # empty one that SLURM refuses at once: never /etc/slurm or a login node's own cluster.
    os.environ["SLURM_CONF"] = str(cluster_conf() or os.devnull)
    config.addinivalue_line("markers", "slurm: takes the cluster fixture (pytest -m slurm)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:  # the tests that submit to the test cluster
        if "cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slurm)


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
def cluster(request: pytest.FixtureRequest) -> Path:
    """The slurm.conf of the test SLURM cluster (scripts/slurm_cluster.sh start), which SLURM_CONF
    names; the test skips while that cluster is not up (fails, with --require-slurm)."""
    why_not = why_not_up()
    if why_not and request.config.getoption("--require-slurm"):
        pytest.fail(why_not)
    if why_not:
        pytest.skip(why_not)
    conf = cluster_conf()
    assert conf is not None
    os.environ["SLURM_CONF"] = str(conf)  # as pytest_configure sets it, were it started since
    return conf
