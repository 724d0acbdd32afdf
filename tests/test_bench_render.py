"""The benchmarks' CPU side: the renderer's tables from a pytest-benchmark report, the old-vs-new comparison, and
the sweeps skipping cleanly without a GPU."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import compare, render
from tests.conftest import gpu

ROOT = Path(__file__).resolve().parents[1]
CEILINGS = dict(read_gbs=3000.0, matmul_tflops=700.0)


def bench_entry(test, group, params, key, us, nbytes=None, flops=None, **fields):
    roofline = max(nbytes / 3e6 if nbytes else 0.0, flops / 7e8 if flops else 0.0)
    extra = dict(key=key, **fields, us=us, bytes=nbytes, flops=flops, **CEILINGS,
                 gbs=nbytes / us / 1e3 if nbytes else None, tflops=None, roofline_us=roofline or None,
                 roofline_frac=roofline / us if roofline else None)
    return dict(group=group, name=test, fullname=f"bench/{test}.py::{group}[x]", params=params, extra_info=extra,
                stats=dict(median=us * 16e-6, rounds=10, data=[us * 16e-6] * 10))


def report():
    machine = dict(bench=dict(gpu="NVIDIA H100 80GB HBM3", arch="sm_90", sms=132, torch="2.11.0", triton="3.6.0",
                              cuda="13.0", python="3.12.3", date="2026-12-07 10:00 UTC"))
    benches = [bench_entry("test_moe", "moe", dict(shape="tp8", M=1, routing="uniform"), "moe tp8 M=1 uniform",
                           17.8, nbytes=24.7e6, experts=8.0, rel_err=0.0021),
               bench_entry("test_moe", "moe", dict(shape="tp8", M=2, routing="uniform"), "moe tp8 M=2 uniform",
                           20.1, nbytes=49.3e6, experts=16.0, rel_err=0.0022),
               bench_entry("test_dense", "linear", dict(N=2112, K=7168, M=1, impl="ops"), "linear 2112x7168 M=1 ops",
                           9.5, nbytes=30.3e6, flops=30.3e6, used_by="q_a+kv_a", rel_err=0.002),
               bench_entry("test_dense", "linear", dict(N=2112, K=7168, M=1, impl="cublas"),
                           "linear 2112x7168 M=1 cublas", 14.0, nbytes=30.3e6, flops=30.3e6, used_by="q_a+kv_a",
                           rel_err=0.0)]
    return dict(machine_info=machine, benchmarks=benches)


def test_render_writes_a_table_per_sweep(tmp_path):
    pages = render.render(report(), tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dense_h100.json", "dense_h100.md", "moe_h100.json",
                                                          "moe_h100.md"]
    moe = pages["moe"]
    assert moe.startswith("# moe sweep (NVIDIA H100 80GB HBM3, 2026-12-07 10:00 UTC)")
    assert "read 3000 GB/s" in moe and "matmul 700 TFLOP/s" in moe and "triton 3.6.0" in moe
    assert "W4A16 MoE sweep" in moe  # the method: the sweep's docstring
    assert "| shape | M | routing | experts | rel_err | us | MB |" in moe
    assert "| tp8 | 1 | uniform | 8.00 | 2.1e-03 | 17.8 | 24.7 | 1388 |" in moe
    dense = pages["dense"]  # the linear cases side by side: one row per shape and M
    assert "| N | K | M | used_by | ops us | cublas us | ops of roofline | cublas of roofline |" in dense
    assert "| 2112 | 7168 | 1 | q_a+kv_a | 9.50 | 14.0 | 106% | 72% |" in dense
    saved = json.loads((tmp_path / "moe_h100.json").read_text())
    assert len(saved["benchmarks"]) == 2 and "data" not in saved["benchmarks"][0]["stats"]
    assert saved["machine_info"]["bench"]["arch"] == "sm_90"


def test_render_refuses_a_file_that_is_not_a_report(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert render.main([str(bad)]) == 2
    assert capsys.readouterr().err.startswith(f"error: {bad}:")
    assert render.gpu_slug("NVIDIA H200") == "h200" and render.gpu_slug("NVIDIA RTX PRO 6000") == "nvidia_rtx_pro_6000"


def test_compare_matches_old_files_to_new_cases(tmp_path, capsys):
    old, new = tmp_path / "old", tmp_path / "new"
    (old / "moe").mkdir(parents=True)
    new.mkdir()
    (old / "moe" / "moe_variants_tp8_uniform.json").write_text(json.dumps(dict(rows=[
        dict(shape="tp8", M=1, routing="uniform", gap=True, variants=dict(default=dict(us=20.0))),
        dict(shape="tp8", M=2, routing="uniform", gap=True, variants=dict(default=dict(us=20.0)))])))
    (old / "linear.json").write_text(json.dumps(dict(shapes=[dict(N=2112, K=7168, names=["q_a+kv_a"], rows={
        "1": dict(cublas_us=14.0, triton={"gemv 32x256": dict(us=9.0, rel_err=0.002)})})])))
    (old / "step.json").write_text(json.dumps(dict(rows=[dict(context=4096, budget=8, verify_graph_ms=8.0,
                                                               step_ms=9.0)])))
    (new / "sweeps.json").write_text(json.dumps(report()))
    (new / "step.json").write_text(json.dumps(dict(rows=[dict(context=4096, budget=8, verify_graph_ms=8.4,
                                                               step_ms=9.0)])))
    assert compare.main([str(old), str(new)]) == 0
    out = capsys.readouterr().out
    assert "| moe | 2 | 0.948 | 0.890 | 1.005 | 1 |" in out  # 17.8 / 20 is off by more than 10%
    assert "| moe tp8 M=1 uniform | 20.00 | 17.80 | 0.890 |" in out
    assert "| linear | 2 | 1.028 |" in out and "| step | 2 | 1.025 |" in out
    assert "6 cases matched" in out
    assert compare.main([str(old / "moe"), str(tmp_path / "nothing")]) == 2


@pytest.mark.skipif(gpu(), reason="the CPU path")
def test_sweeps_skip_cleanly_without_a_gpu():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "bench"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert " skipped" in proc.stdout and "passed" not in proc.stdout and "failed" not in proc.stdout
