"""triton_kernels.arch: detection, the override (SPEC_ARCH), the warned fallback, and every table keyed by an arch."""

import importlib
import os
import pkgutil
import re
import subprocess
import sys

import pytest
import torch

import triton_kernels
from tests.conftest import compiled_in_child, gpu, requires_gpu
from triton_kernels import arch, tuning


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA machine whose device reports the capability set on the returned dict."""
    capability = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["value"])
    monkeypatch.delenv("DISABLE_MMA_V3", raising=False)
    return capability


@pytest.fixture(autouse=True)
def no_override():
    """Each test starts and ends without an override (the suite may run under SPEC_ARCH)."""
    before = arch.overridden()
    arch.use(None)
    yield
    arch.use(before)


def test_detection_on_a_faked_capability(fake_gpu):
    cuda = torch.device("cuda", 0)
    for capability, key in (((9, 0), "sm_90"), ((12, 0), "sm_120")):
        fake_gpu["value"] = capability
        assert arch.device_arch(cuda) == arch.current(cuda) == arch.current() == key
    assert arch.current(torch.device("cpu")) == "sm_90" and arch.device_arch(torch.device("cpu")) is None


def test_cpu_runs_sm90_tables_without_a_warning(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert arch.current() == arch.current(torch.device("cpu")) == "sm_90"
    assert arch.sm_count(torch.device("cpu")) == 4
    assert capsys.readouterr().err == ""


def test_an_arch_without_tables_falls_back_with_one_warning(fake_gpu, capsys):
    cuda = torch.device("cuda", 0)
    fake_gpu["value"] = (10, 3)
    assert [arch.current(cuda) for _ in range(3)] == ["sm_90"] * 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("warning: no kernel tables for sm_103; running sm_90's"), err
    fake_gpu["value"] = (12, 1)
    assert arch.current(cuda) == "sm_120"
    assert "sm_121" in capsys.readouterr().err


def test_override_by_function(fake_gpu, shipped_tables):
    """using("sm_120") on a Hopper GPU: sm_120's tables, no Hopper-only paths, tl.dot lowered to mma.sync
    (DISABLE_MMA_V3=1), grids still sized from the GPU at hand; everything put back afterwards."""
    from triton_kernels import ddtree, linear, moe_configs

    cuda = torch.device("cuda", 0)
    assert arch.hopper_features(cuda)
    with arch.using("sm_120"):
        assert arch.current(cuda) == arch.current(torch.device("cpu")) == "sm_120"
        assert arch.device_arch(cuda) == "sm_90" and not arch.hopper_features(cuda)
        assert os.environ["DISABLE_MMA_V3"] == "1"
        assert arch.shared_limit() == 101_376
        shipped = tuning.moe_entry("sm_120", 1, 256)  # the shipped tuned file's, for the TP8 rank's experts
        assert shipped is not None and moe_configs.config_for(cuda, 1, intermediate=256) == shipped
        tuning.use(tuning.DEFAULTS)
        try:
            want = moe_configs.CONFIGS["sm_120"][0][1]  # BM 16, in the arch's layout
            assert moe_configs.config_for(cuda, 1) == {**want, "kmajor": moe_configs.KMAJOR["sm_120"]}
            assert linear.adopted(cuda, 4, 1536, 1536) is None
        finally:
            tuning.use(None)
        assert ddtree.CONFIGS[arch.current(cuda)]["warps_v"] == 4
    assert "DISABLE_MMA_V3" not in os.environ and arch.current(cuda) == "sm_90"
    assert moe_configs.config_for(cuda, 1)["BM"] == 8


def test_override_keeps_a_switch_set_before(fake_gpu, monkeypatch):
    monkeypatch.setenv("DISABLE_MMA_V3", "0")
    with arch.using("sm_120"):
        assert os.environ["DISABLE_MMA_V3"] == "1"
    assert os.environ["DISABLE_MMA_V3"] == "0"
    with arch.using("sm_90"):  # an arch with wgmma leaves it alone
        assert os.environ["DISABLE_MMA_V3"] == "0"


def test_override_on_cpu_leaves_the_switch_alone(monkeypatch):
    """Without CUDA nothing compiles for a GPU here: the interpreter runs sm_120's tables and code paths."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("DISABLE_MMA_V3", raising=False)
    with arch.using("sm_120"):
        assert arch.current() == "sm_120" and "DISABLE_MMA_V3" not in os.environ


def test_unknown_override_is_refused():
    with pytest.raises(ValueError, match="SPEC_ARCH: unknown arch 'sm_99'; the archs with tables are sm_90, sm_120"):
        arch.use("sm_99")
    assert arch.overridden() is None
    with pytest.raises(ValueError, match="not an architecture key"):
        arch.capability(90)


def test_override_from_the_environment():
    code = "import json; from triton_kernels import arch; print(json.dumps([arch.current(), arch.overridden()]))"
    assert compiled_in_child(code, env={"SPEC_ARCH": "sm_120"}) == ["sm_120", "sm_120"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", "import triton_kernels.arch"], env={**env, "SPEC_ARCH": "sm_99"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "SPEC_ARCH: unknown arch 'sm_99'" in proc.stderr


def arch_tables():
    """Every public module-level dict of triton_kernels whose keys look like architectures ('sm_90', or the ints 90
    and 120 of an older form): (module.name, its keys)."""
    found = []
    for info in pkgutil.iter_modules(triton_kernels.__path__):
        if info.name == "mla_gluon":
            pytest.importorskip("triton.experimental.gluon.language.nvidia.hopper")
        module = importlib.import_module(f"triton_kernels.{info.name}")
        for name, value in vars(module).items():
            if not name.startswith("_") and isinstance(value, dict) and any(
                    (isinstance(k, str) and re.fullmatch(r"sm_\d+", k)) or k in (80, 90, 100, 120) for k in value):
                found.append((f"{info.name}.{name}", set(value)))
    return found


def test_every_table_is_keyed_by_the_known_archs():
    tables = arch_tables()
    names = {name for name, _ in tables}
    assert {"moe_configs.CONFIGS", "linear.ADOPTED", "mla_attention.CONFIGS", "mla_splits.SPLIT_RULE",
            "ddtree.CONFIGS", "router.MANY_ROWS", "absorb.OUTPUT_TILES", "arch.SHARED_LIMIT"} <= names
    for name, keys in tables:
        assert keys == set(arch.ARCHS), (name, keys)


@requires_gpu
def test_sm120_proxy_compiles_within_sm120_limits_gpu():
    """Under SPEC_ARCH=sm_120 on this GPU, the MoE, attention, skinny GEMM, router and draft top-k compile every
    kernel they launch within sm_120's shared memory and without wgmma (tl.dot on mma.sync)."""
    if gpu() and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the proxy is for a Hopper GPU")
    report = compiled_in_child(PROXY_RUN, env={"SPEC_ARCH": "sm_120"})
    assert report["arch"] == "sm_120" and report["switch"] == "1" and report["kernels"] >= 8, report
    assert report["over_limit"] == [] and report["wgmma"] == [], report


PROXY_RUN = """
import json, os
import torch
import ops
import triton_kernels
from triton.runtime.jit import JITFunction
from triton_kernels import arch, linear, mla_attention, moe_layout, moe_w4a16, router
from tests.test_moe_kernel import make_experts, make_routing

torch.manual_seed(0)
raw = make_experts(8, 7168, 256)
prepared = moe_layout.prepare_moe(*raw)
for M in (1, 9, 40):
    ids, weights = make_routing(M, 8, 4)
    moe_w4a16.moe(torch.randn(M, 7168, device="cuda").bfloat16(), ids, weights, prepared)
for T, H in ((1, 8), (9, 8), (33, 8)):
    q = torch.randn(1, T, H, 576, device="cuda").bfloat16()
    kv = torch.randn(1, 4096, 576, device="cuda").bfloat16()
    mla_attention.mla_attention(q, kv, torch.tensor([4000], dtype=torch.int32, device="cuda"), None, 0.1)
for M in (1, 4):
    linear.linear_kernel(torch.randn(M, 1536, device="cuda").bfloat16(), torch.randn(1536, 1536, device="cuda").bfloat16())
for M in (1, 9, 130):
    router.route(torch.randn(M, 7168, device="cuda").bfloat16(), torch.randn(384, 7168, device="cuda").bfloat16(),
                 torch.zeros(384, device="cuda"), 8, 1, 1, 2.5)
logits = torch.randn(1, 4, 2000, device="cuda")
with ops.using(draft_topk="triton"):
    ops.draft_topk(logits, 8)
torch.cuda.synchronize()
kernels, over, wgmma = 0, [], []
for name in dir(triton_kernels):
    module = getattr(triton_kernels, name)
    for value in vars(module).values() if hasattr(module, "__dict__") else ():
        if isinstance(value, JITFunction):
            for caches in value.device_caches.values():
                for compiled in caches[0].values():
                    kernels += 1
                    if compiled.metadata.shared > arch.SHARED_LIMIT["sm_120"]:
                        over.append((value.__name__, compiled.metadata.shared))
                    if "wgmma" in compiled.asm["ptx"]:
                        wgmma.append(value.__name__)
print(json.dumps(dict(arch=arch.current(), switch=os.environ.get("DISABLE_MMA_V3"), kernels=kernels,
                      over_limit=over, wgmma=wgmma)))
"""
