"""The kernel sweeps' pytest setup: GPU-clock timing for every benchmark, one table group per test function, the
ceilings measured once a session, the GPU and versions in the JSON; without CUDA every sweep is skipped.

    pytest bench --benchmark-json F.json              # time every sweep, then: python -m bench.render F.json
    pytest bench -n 8 --benchmark-disable             # (pytest-xdist) run each case once: compiles, no timing
    pytest bench --bench-seconds 300 --benchmark-json F.json   # cases not started by then are skipped
"""

import time

import pytest
import torch

from bench.common import Ceilings, GpuStamp, metadata


def pytest_addoption(parser):
    parser.addoption("--bench-seconds", type=float, default=None,
                     help="skip the cases not started this many seconds after the session began (the JSON of "
                          "those that ran is still written)")


def pytest_configure(config):
    config.bench_start = time.monotonic()


def pytest_runtest_setup(item):
    limit = item.config.getoption("--bench-seconds")
    if limit is not None and time.monotonic() - item.config.bench_start > limit:
        pytest.skip(f"--bench-seconds {limit:g} spent")


def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(pytest.mark.benchmark(timer=GpuStamp, group=item.originalname.removeprefix("test_")))
        if not torch.cuda.is_available():
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))


@pytest.hookimpl(optionalhook=True)
def pytest_benchmark_update_machine_info(config, machine_info):
    if torch.cuda.is_available():
        machine_info["bench"] = metadata()


@pytest.fixture(scope="session")
def ceilings():
    return Ceilings()
