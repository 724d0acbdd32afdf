"""`python -m bench.collectives` under torchrun: two gloo ranks on the CPU time the process group's all-reduce and
logits all-gather and write the report (the symmetric-memory methods skipped off CUDA); two GPUs also run them."""

import json
import os
import subprocess
import sys

import pytest
import torch

from bench.collectives import NO_MULTICAST, main, percentile, step_totals
from model.config import preset
from tests.conftest import free_port
from tests.test_decode_cli import PYTHONPATH, ROOT

ROWS = (1, 8, 9)


def torchrun_collectives(out, *args, ranks=2):
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                           "--master-port", str(free_port()), "-m", "bench.collectives", "--out", str(out),
                           "--rows", ",".join(map(str, ROWS)), "--preset", "tiny", "--iters", "5", "--warmup", "1",
                           *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "collectives.json").read_text())


def test_two_gloo_ranks_write_the_report(tmp_path):
    report = torchrun_collectives(tmp_path, "--device", "cpu")
    cfg = preset("tiny")
    assert report["meta"]["ranks"] == 2 and report["meta"]["backend"] == "gloo"
    assert set(report["skipped"]) == {"symm_one_shot", "symm_two_shot"}
    cases = {(r["collective"], r["rows"]): r for r in report["rows"]}
    assert set(cases) == {(c, rows) for c in ("all_reduce", "all_gather") for rows in ROWS}
    for (collective, rows), r in cases.items():
        assert (r["method"], r["mode"]) == ("process_group", "eager")
        width = cfg.hidden_size if collective == "all_reduce" else cfg.vocab_size
        assert r["shape"] == [rows, width] and r["bytes"] == rows * width * 2  # bf16
        assert 0 < r["median_us"] <= r["p99_us"]
    steps = {s["budget"]: s["step_collectives_us"] for s in report["steps"]}
    assert set(steps) == {0, 8}  # rows 8 is the drafter's block, not a budget
    median = {k: r["median_us"] for k, r in cases.items()}
    assert steps[0] == pytest.approx(2 * cfg.num_hidden_layers * median["all_reduce", 1] + median["all_gather", 1])
    assert steps[8] == pytest.approx(2 * cfg.num_hidden_layers * median["all_reduce", 9] + median["all_gather", 9]
                                     + 2 * report["draft_layers"] * median["all_reduce", 8]
                                     + median["all_gather", 8])
    table = (tmp_path / "collectives.md").read_text()
    assert "| all_reduce | process_group | eager | 9 | " in table and "symm_one_shot: needs CUDA" in table


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_gpus_time_nccl_and_symmetric_memory(tmp_path):
    """On two GPUs every method is checked exactly and timed eagerly and in a CUDA graph."""
    report = torchrun_collectives(tmp_path, "--device", "cuda")
    methods = {(r["method"], r["mode"]) for r in report["rows"] if r["collective"] == "all_reduce"}
    expected = {(m, mode) for m in ("process_group", "symm_one_shot", "symm_two_shot") for mode in ("eager", "graph")}
    assert methods | {(m, mode) for m in report["skipped"] for mode in ("eager", "graph")} == expected


def test_percentile_is_nearest_rank():
    values = list(range(1, 101))
    assert (percentile(values, 50), percentile(values, 99), percentile([7.0], 99)) == (50, 99, 7.0)


def test_step_totals_need_the_drafters_block():
    results = [dict(collective="all_reduce", method="process_group", mode="eager", rows=9, median_us=2.0),
               dict(collective="all_gather", method="process_group", mode="eager", rows=9, median_us=5.0)]
    assert step_totals(results, layers=3, draft_layers=1, block=8) == []


def test_alone_is_a_usage_error(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for key, value in NO_MULTICAST.items():  # run() sets them where unset: undone after the test
        monkeypatch.setenv(key, os.environ.get(key, value))
    assert main(["--out", str(tmp_path), "--device", "cpu"]) == 2
    assert capsys.readouterr().err.startswith("error: run under torchrun with 2 or more ranks")
