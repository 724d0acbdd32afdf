import json
import os
import socket
import subprocess
import sys
from contextlib import contextmanager

import pytest
import torch

import ops

_real_empty, _real_empty_like = torch.empty, torch.empty_like


def _nan_fill(t):
    if t.is_floating_point():
        t.fill_(float("nan"))
    return t


@pytest.fixture(autouse=True)
def nan_empty(monkeypatch):
    """Fill float torch.empty/empty_like with NaN, so an output element a kernel forgets to write fails."""
    monkeypatch.setattr(torch, "empty", lambda *a, **k: _nan_fill(_real_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: _nan_fill(_real_empty_like(*a, **k)))


@pytest.fixture(autouse=True)
def restore_backends():
    """Each test's backend choices are undone after it."""
    with ops.using():
        yield


@pytest.fixture
def python_tables():
    """The kernels' Python tables in force during the test, whatever tuned file the package ships (tests of the
    tables themselves)."""
    from triton_kernels import tuning

    tuning.use(tuning.DEFAULTS)
    yield
    tuning.use(None)


@pytest.fixture
def shipped_tables(monkeypatch):
    """The package's shipped tuned files in force during the test, whatever file SPEC_KERNEL_CONFIGS names (tests
    of the shipped files)."""
    from triton_kernels import tuning

    monkeypatch.delenv(tuning.ENV_VAR, raising=False)
    tuning.use(None)
    yield
    tuning.use(None)


def interpreting():
    return os.environ.get("TRITON_INTERPRET") == "1"


def gpu():
    return torch.cuda.is_available()


TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # where tests that run Triton kernels put tensors


def kernel_dtypes():
    """Dtypes to test Triton kernels with: the interpreter gets bf16 tl.dot wrong, so fp16/fp32 there."""
    return [torch.bfloat16, torch.float16] if gpu() else [torch.float16, torch.float32]


def free_port():
    """A TCP port free on this host now (for a gloo process group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def gloo_rank(rank, port, world=2):
    """This process as rank `rank` of a gloo group of `world` on 127.0.0.1:port (one thread), torn down after."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


requires_triton = pytest.mark.skipif(not (gpu() or interpreting()), reason="needs CUDA or TRITON_INTERPRET=1")
requires_gpu = pytest.mark.skipif(not gpu(), reason="needs CUDA")


def compiled_in_child(code, *args, env=None):
    """Run the Python program `code` (with args) in a child process without TRITON_INTERPRET, where kernels compile
    ahead of time (under the interpreter they are interpreter objects), and without an arch override (SPEC_ARCH and
    the DISABLE_MMA_V3 it sets: the child compiles for the targets it names) unless `env` sets them, and return its
    last stdout line as JSON."""
    child_env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "SPEC_ARCH", "DISABLE_MMA_V3")}
    child_env.update(env or {})
    proc = subprocess.run([sys.executable, "-c", code, *args], env=child_env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
