"""`python -m spec.decode`: the README's first command, --json, losslessness and seeds through the CLI, and one
clear error line with exit code 2 for each kind of bad input."""

import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from spec.decode import main
from spec.default_model import TARGET, drafter_config, write_default
from spec.drafter import DFlashDrafter
from spec.drafter_checkpoint import checkpoint_tensors, write_drafter_checkpoint
from tests.test_ci import readme_commands

ROOT = Path(__file__).resolve().parents[1]
PYTHONPATH = os.pathsep.join([str(ROOT / "src"), str(ROOT)])  # this checkout's ops, model and spec


def cli(*args, timeout=120):
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    env.pop("SPEC_KERNELS", None)
    return subprocess.run([sys.executable, "-m", "spec.decode", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=timeout)


def test_readme_first_command_prints_text_and_stats_fast():
    """The README's first command, within a minute. On a GPU an untimed run goes first: it compiles the Triton
    kernels, which a parallel test run's other compiles can stretch past minutes."""
    command = shlex.split(readme_commands()[0].split("&&")[1])
    assert command[:3] == ["python", "-m", "spec.decode"]
    if torch.cuda.is_available():
        warm = cli(*command[3:], timeout=600)
        assert warm.returncode == 0, warm.stderr
    start = time.perf_counter()
    proc = cli(*command[3:])
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr
    text, stats = proc.stdout.rstrip("\n").rsplit("\n", 1)
    assert text.strip()
    assert re.match(r"\[DDTree auto \(budget \d+ x\d+(, \d+ x\d+)*\)\] 64 tokens in ", stats) and "tok/s" in stats
    assert elapsed < 60
    accept = float(re.search(r"mean accept length ([0-9.]+)", stats)[1])
    assert accept > 1.5, "the shipped drafter no longer fits the default target: python -m spec.default_model"
    assert run_json(*command[3:])["text"] == text  # the streamed text is the whole text


def run_json(*args):
    proc = cli("--json", *args)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_json_output_lossless_and_seeded():
    spec = run_json("--prompt", "Hello", "--max-new-tokens", "24", "--tree-budget", "8")
    assert {"output_ids", "text", "accept_lengths", "mean_accept_length", "tokens_per_s", "steps"} <= spec.keys()
    assert len(spec["output_ids"]) == 24 and spec["steps"] == len(spec["accept_lengths"])
    assert spec["mean_accept_length"] == pytest.approx(sum(spec["accept_lengths"]) / spec["steps"])
    plain = run_json("--prompt", "Hello", "--max-new-tokens", "24", "--no-spec")
    assert plain["output_ids"] == spec["output_ids"]
    ids = ",".join(str(b) for b in b"Hello")
    assert run_json("--prompt-ids", ids, "--max-new-tokens", "24")["output_ids"] == spec["output_ids"]
    # the step times auto picks by are measured per process unless given: given, the budgets and so the sampled
    # tokens repeat (a different tree draws other nodes' seeded noise)
    table = ROOT / "bench" / "results" / "step_h100_s27.json"
    sampled = [run_json("--prompt", "Hi", "--max-new-tokens", "12", "--temperature", "0.8", "--seed", "5",
                        "--chat", "--kernels", "attention=torch", "--latency-table", str(table))["output_ids"]
               for _ in range(2)]
    assert sampled[0] == sampled[1]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A target with a 48-token context and its drafter, plus drafters that do not fit it."""
    root = tmp_path_factory.mktemp("cli")
    cfg = dataclasses.replace(TARGET, max_position_embeddings=48)
    target, drafter = write_default(root / "ok", target_cfg=cfg)
    bad = {}
    for name, change in {"hidden": dict(hidden_size=64), "vocab": dict(vocab_size=1024),
                         "layers": dict(target_layer_ids=(0, 5))}.items():
        dcfg = dataclasses.replace(drafter_config(cfg), **change)
        bad[name] = root / name
        write_drafter_checkpoint(bad[name], dcfg, checkpoint_tensors(DFlashDrafter(dcfg, dtype=torch.float32)))
    return target, drafter, bad


def bad_input(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len([line for line in err if line.startswith("error:")]) == 1
    assert err[-1].startswith("error: ") and message in err[-1], err[-1]


@pytest.mark.parametrize("argv, message", [
    (["--prompt", "x", "--tree-budget", "0"], "--tree-budget must be in 1..512"),
    (["--prompt", "x", "--tree-budget", "513"], "--tree-budget must be in 1..512"),
    (["--prompt", "x", "--kernels", "warp=triton"], "unknown op 'warp'"),
    (["--prompt", "x", "--kernels", "moe=cuda"], "unknown backend 'cuda'"),
    (["--prompt", "x", "--kernels", "drafter_attention=triton"], "has no Triton kernel"),
    (["--prompt-ids", "1,x"], "--prompt-ids"),
    (["--max-new-tokens", "4"], "give a prompt"),
    (["--prompt", "x", "--temperature", "-1"], "temperature"),
    (["--prompt", "x", "--model-path", "/nonexistent/k26", "--no-spec"], "/nonexistent/k26 is not a directory"),
    (["--prompt", "x", "--draft-model-path", "/tmp"], "--draft-model-path needs --model-path"),
])
def test_bad_arguments(capsys, argv, message):
    bad_input(capsys, argv, message)


@pytest.mark.parametrize("case, message", [
    ("missing", "is not a directory"),
    ("hidden", "hidden_size 64 does not match the target's 128"),
    ("vocab", "vocab_size 1024 does not match the target's 512"),
    ("layers", "target_layer_ids [5] out of range"),
    ("long", "prompt 0 has 60 tokens; the context holds 48"),
    ("empty", "config.json does not exist"),
    ("corrupt", "is not a readable safetensors file"),
])
def test_bad_checkpoints_and_prompts(capsys, tmp_path, checkpoints, case, message):
    target, drafter, bad = checkpoints
    if case == "corrupt":
        shutil.copytree(drafter, tmp_path / "corrupt")
        (tmp_path / "corrupt" / "model.safetensors").write_bytes(b"not a safetensors file")
    drafter = {"missing": tmp_path / "nothing", "long": drafter, "empty": tmp_path,
               "corrupt": tmp_path / "corrupt"}.get(case, bad.get(case))
    prompt = ["--prompt-ids", ",".join(["65"] * 60)] if case == "long" else ["--prompt", "x"]
    bad_input(capsys, ["--json", "--model-path", str(target), "--draft-model-path", str(drafter), *prompt], message)


def torchrun_json(*args, ranks=2):
    """The one JSON line rank 0 prints under `torchrun --nproc-per-node ranks -m spec.decode --json args`."""
    from tests.conftest import free_port

    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1"}
    env.pop("SPEC_KERNELS", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                           "--master-port", str(free_port()), "-m", "spec.decode", "--json", *args],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1
    return json.loads(lines[0])


@pytest.mark.parametrize("budget", ["8", "auto"])
def test_torchrun_two_ranks_decode_like_one_process(budget):
    """`torchrun --nproc-per-node 2 -m spec.decode`: two gloo ranks, each holding half of the target and the
    drafter, emit the single process's tokens; rank 0 alone prints. Under auto the ranks pick alike."""
    args = ["--prompt", "Hello", "--max-new-tokens", "16", "--tree-budget", budget, "--device", "cpu"]
    assert torchrun_json(*args)["output_ids"] == run_json(*args)["output_ids"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_torchrun_two_gpus_nccl_graphs_equal_eager():
    """Two NCCL ranks on two GPUs: the all-reduces captured inside the CUDA graphs give the tokens of the same
    two ranks run eagerly (graph buckets pad the tree; padding must not change a token)."""
    args = ["--prompt", "Hello", "--max-new-tokens", "32", "--tree-budget", "8", "--device", "cuda"]
    graphs = torchrun_json(*args)
    assert len(graphs["output_ids"]) == 32
    assert graphs["output_ids"] == torchrun_json(*args, "--no-cuda-graphs")["output_ids"]
