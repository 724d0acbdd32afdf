"""Hostile input, in process: every class of bad input ends `python -m spec.decode` with one `error: ...` line
naming what and where, exit 2 (1 for a runtime failure, with sizes), no traceback and nothing on stdout; the
library raises TypeError/ValueError with the same message. Classes: index paths, config types, shard headers
against the config, tensor dtypes and shapes, sizes and memory, non-finite values, sampling values, the
environment, the library API, the tokenizer. Process-level cases (signals, pipes, ranks): test_hostile_process.py.
"""

import base64
import dataclasses
import json
import os
import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import model.checkpoint as checkpoint_module
import model.memory as memory
import ops
from model.checkpoint import INDEX_FILE, load_model
from model.checkpoint_writer import random_tensors, write_checkpoint
from model.config import ModelConfig, preset
from model.generate import greedy_generate
from model.model import KimiModel
from model.tokenizer import ByteTokenizer, KimiTokenizer, load_tokenizer
from spec.decode import main as decode_main
from spec.default_model import TARGET, drafter_config
from spec.drafter import DFlashDrafter
from spec.drafter_checkpoint import (checkpoint_tensors, drafter_entries, load_drafter,
                                     write_drafter_checkpoint)
from spec.engine import Engine, NonFiniteLogits, SamplingParams
from tests.test_model_vs_hf import one_thread  # noqa: F401 (autouse fixture)

CFG = dataclasses.replace(TARGET, max_position_embeddings=64)
BODY = "language_model.model."


# --- fixtures: a sharded tiny target and a sharded drafter, copied fresh for each test -------------------------

def shard_drafter(path):
    """Split a drafter's model.safetensors into two shards with an index."""
    tensors = load_file(path / "model.safetensors")
    names = sorted(tensors)
    parts = {"drafter-1.safetensors": names[: len(names) // 2], "drafter-2.safetensors": names[len(names) // 2 :]}
    for file, part in parts.items():
        save_file({n: tensors[n] for n in part}, path / file)
    (path / "model.safetensors").unlink()
    weight_map = {n: file for file, part in parts.items() for n in part}
    (path / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("hostile")
    write_checkpoint(root / "target", CFG, random_tensors(CFG, seed=3), shard_size_bytes=400_000)
    dcfg = drafter_config(CFG)
    write_drafter_checkpoint(root / "drafter", dcfg, checkpoint_tensors(DFlashDrafter(dcfg, torch.float32)
                                                                        .init_random_(4)))
    shard_drafter(root / "drafter")
    return root


@pytest.fixture
def paths(pristine, tmp_path):
    """(target dir, drafter dir) in tmp_path/models, next to a valid shard tmp_path/secret.safetensors."""
    for name in ("target", "drafter"):
        shutil.copytree(pristine / name, tmp_path / "models" / name)
    shutil.copy(sorted((pristine / "target").glob("model-*.safetensors"))[0], tmp_path / "secret.safetensors")
    return tmp_path / "models" / "target", tmp_path / "models" / "drafter"


def args(paths, *extra):
    target, drafter = paths
    return ["--model-path", str(target), "--draft-model-path", str(drafter), "--prompt", "hi",
            "--max-new-tokens", "4", "--json", *extra]


def main(argv):
    """spec.decode's main on the CPU (where these behaviours are pinned, also on a machine with a GPU), unless argv
    names a device."""
    names_device = any(a == "--device" or a.startswith("--device=") for a in argv)
    return decode_main(argv if names_device else [*argv, "--device", "cpu"])


def refused(capsys, argv, *needles, code=2):
    """main(argv) exits `code` with exactly one line on stderr, `error: ...` containing every needle, and
    nothing on stdout. Returns that line."""
    rc = main(argv)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == code and out == "" and len(lines) == 1 and lines[0].startswith("error: "), (rc, out, err)
    for needle in needles:
        assert str(needle) in lines[0], (needle, lines[0])
    return lines[0]


def edit_json(file, change):
    data = json.loads(file.read_text())
    change(data)
    file.write_text(json.dumps(data))


def index_entry(folder, name=None):
    """(a tensor name of the index, the shard file it points to)."""
    weight_map = json.loads((folder / INDEX_FILE).read_text())["weight_map"]
    name = name or sorted(weight_map)[0]
    return name, weight_map[name]


def point(folder, written):
    """Point every tensor of the first shard of `folder`'s index at `written` instead."""
    _, shard = index_entry(folder)
    edit_json(folder / INDEX_FILE, lambda d: d["weight_map"].update(
        {n: written for n, f in d["weight_map"].items() if f == shard}))


# --- index paths ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("which", [0, 1], ids=["target", "drafter"])
def test_index_paths_outside_the_folder_are_refused_alike(capsys, paths, which):
    """'..', absolute paths and symlinks out of the folder: one message, whether or not the file exists."""
    folder = paths[which]
    secret = folder.parent.parent / "secret.safetensors"
    (folder / "link.safetensors").symlink_to(secret)
    (folder / "dangling.safetensors").symlink_to(secret.with_name("nothing.safetensors"))
    original = (folder / INDEX_FILE).read_text()
    seen = {}
    for written in ("../../secret.safetensors", "../../nothing.safetensors", str(secret),
                    str(secret.with_name("nothing.safetensors")), "link.safetensors", "dangling.safetensors",
                    "sub/../../../secret.safetensors"):
        (folder / INDEX_FILE).write_text(original)
        point(folder, written)
        seen[written] = refused(capsys, args(paths), folder / INDEX_FILE, "outside the model folder").replace(
            written, "NAME")
    assert len(set(seen.values())) == 1, seen


@pytest.mark.parametrize("which", [0, 1], ids=["target", "drafter"])
@pytest.mark.parametrize("case, needle", [
    ("directory", "which is a directory"), ("missing", "which does not exist"), ("number", "which is not a file name"),
    ("empty", "which is not a file name"), ("no-weight-map", "has no weight_map"), ("list", "must hold a JSON object"),
    ("not-json", "is not valid JSON"), ("nan", "is not valid JSON"), ("index-dir", "is a directory"),
])
def test_bad_index_entries_name_the_index(capsys, paths, which, case, needle):
    folder = paths[which]
    index = folder / INDEX_FILE
    if case == "directory":
        (folder / "shard.d").mkdir()
        point(folder, "shard.d")
    elif case in ("missing", "number", "empty"):
        point(folder, {"missing": "gone.safetensors", "number": 5, "empty": ""}[case])
    elif case == "no-weight-map":
        index.write_text(json.dumps({"metadata": {}}))
    elif case in ("list", "not-json", "nan"):
        index.write_text({"list": "[1, 2]", "not-json": '{"weight_map": ', "nan": '{"weight_map": NaN}'}[case])
    else:
        index.unlink()
        index.mkdir()
    refused(capsys, args(paths), index, needle)


def test_hf_cache_snapshot_symlinks_into_blobs_load(capsys, paths, tmp_path):
    """The HF hub cache layout: snapshots/<rev>/<file> are symlinks to ../../blobs/<hash>."""
    models = []
    for folder in paths:
        repo = tmp_path / "hub" / f"models--org--{folder.name}"
        (repo / "blobs").mkdir(parents=True)
        snapshot = repo / "snapshots" / "0123abc"
        snapshot.mkdir(parents=True)
        for i, file in enumerate(sorted(folder.iterdir())):
            shutil.copy(file, repo / "blobs" / f"blob{i:04d}")
            (snapshot / file.name).symlink_to(Path("..", "..", "blobs", f"blob{i:04d}"))
        models.append(snapshot)
    assert main(args(models)) == 0
    assert len(json.loads(capsys.readouterr().out)["output_ids"]) == 4


# --- config types --------------------------------------------------------------------------------------------

def _text(change):
    return lambda d: change(d["text_config"])


@pytest.mark.parametrize("change, needles", [
    (lambda d: None, ("must hold a JSON object, got a list",)),
    (lambda d: d.update(text_config=None), ("text_config must be an object, got null",)),
    (_text(lambda t: t.update(hidden_size="128")), ('text_config.hidden_size must be an integer, got "128"',)),
    (_text(lambda t: t.update(num_hidden_layers=2.5)), ("text_config.num_hidden_layers must be an integer",)),
    (_text(lambda t: t.update(num_attention_heads=True)), ("text_config.num_attention_heads must be an integer",)),
    (_text(lambda t: t.update(kv_lora_rank=-512)), ("text_config.kv_lora_rank must be positive",)),
    (_text(lambda t: t.update(n_group=0)), ("text_config.n_group must be positive",)),
    (_text(lambda t: t.update(norm_topk_prob="yes")), ("text_config.norm_topk_prob must be true or false",)),
    (_text(lambda t: t.update(rms_norm_eps=None, routed_scaling_factor=[1])), ("routed_scaling_factor",)),
    (_text(lambda t: t.pop("vocab_size")), ("missing 'text_config.vocab_size'",)),
    (_text(lambda t: t.update(max_position_embeddings=None)), ("missing 'text_config.max_position_embeddings'",)),
    (_text(lambda t: t["rope_scaling"].pop("factor")), ("missing 'text_config.rope_scaling.factor'",)),
    (_text(lambda t: t["rope_scaling"].update(type="longrope")), ("text_config.rope_scaling has unsupported type",)),
    (_text(lambda t: t.update(rope_scaling="yarn")), ("text_config.rope_scaling must be an object",)),
    (_text(lambda t: t["rope_scaling"].update(beta_fast=-1)), ("rope_scaling.beta_fast must be a positive",)),
    (_text(lambda t: t.update(rope_theta=1)), ("text_config.rope_theta must be greater than 1",)),
    (_text(lambda t: t.update(eos_token_id=[])), ("text_config.eos_token_id is an empty list",)),
    (_text(lambda t: t.update(scoring_func="softmax")), ("text_config.scoring_func",)),
    (lambda d: d["quantization_config"].update(config_groups=[]), ("quantization_config.config_groups must be",)),
    (lambda d: d["quantization_config"]["config_groups"]["group_0"]["weights"].update(num_bits=4.0),
     ("quantization_config.config_groups.group_0.weights.num_bits must be an integer",)),
])
def test_target_config_types(capsys, paths, change, needles):
    config = paths[0] / "config.json"
    if needles[0].startswith("must hold"):
        config.write_text("[1, 2]")
    else:
        edit_json(config, change)
    refused(capsys, args(paths), config, *needles)


@pytest.mark.parametrize("change, needle", [
    (lambda text: '{"text_config": NaN}', "is not valid JSON: NaN is not valid JSON"),
    (lambda text: "\udcff\udcfe", "is not UTF-8 text"),
    (lambda text: "[" * 100_000, "is not valid JSON"),
    (lambda text: text.replace('"hidden_size": 128', '"hidden_size": 1e999'),
     "hidden_size must be an integer, got inf"),
    (lambda text: text.replace('"rope_theta": 50000.0', '"rope_theta": -1e999'), "rope_theta must be a finite number"),
])
def test_target_config_files_that_do_not_parse(capsys, paths, change, needle):
    config = paths[0] / "config.json"
    config.write_bytes(change(config.read_text()).encode("utf-8", "surrogateescape"))
    refused(capsys, args(paths), config, needle)


def test_config_that_is_a_pipe_or_a_directory(capsys, paths):
    config = paths[0] / "config.json"
    config.unlink()
    os.mkfifo(config)  # reading it would block forever
    refused(capsys, args(paths), config, "is not a regular file")
    config.unlink()
    config.mkdir()
    refused(capsys, args(paths), config, "is a directory")


@pytest.mark.parametrize("change, needles", [
    (lambda d: d.update(hidden_size="128"), ('hidden_size must be an integer, got "128"',)),
    (lambda d: d.update(block_size=2.5), ("block_size must be an integer",)),
    (lambda d: d["dflash_config"].update(target_layer_ids=[0, 1.5]), ("dflash_config.target_layer_ids",)),
    (lambda d: d["dflash_config"].update(target_layer_ids="0,2"), ("dflash_config.target_layer_ids must be a list",)),
    (lambda d: d.update(dflash_config=[1]), ("dflash_config must be an object",)),
    (lambda d: d["dflash_config"].update(mask_token_id=True), ("dflash_config.mask_token_id must be an integer",)),
    (lambda d: d.update(num_key_value_heads=3), ("num_key_value_heads 3 does not divide",)),
    (lambda d: d.update(rope_scaling={"type": "yarn"}), ("missing 'rope_scaling.factor'",)),
    (lambda d: d.update(rms_norm_eps=-1e-6), ("rms_norm_eps must be positive",)),
    (lambda d: d.pop("intermediate_size"), ("missing 'intermediate_size'",)),
])
def test_drafter_config_types(capsys, paths, change, needles):
    config = paths[1] / "config.json"
    edit_json(config, change)
    refused(capsys, args(paths), config, *needles)


def test_library_config_errors_are_value_errors():
    hf = CFG.to_hf()
    hf["text_config"]["hidden_size"] = "128"
    with pytest.raises(ValueError, match='/m/config.json: text_config.hidden_size must be an integer, got "128"'):
        ModelConfig.from_hf(hf, "/m/config.json")
    with pytest.raises(ValueError, match="config: num_hidden_layers must be an integer"):
        dataclasses.replace(CFG, num_hidden_layers=2.5)
    with pytest.raises(ValueError, match="drafter config: block_size must be an integer"):
        dataclasses.replace(drafter_config(CFG), block_size=8.0)


# --- shard headers against the config, and sizes -------------------------------------------------------------

@pytest.mark.parametrize("which, key, value, needles", [
    (0, "hidden_size", 10**9, ("embed_tokens.weight has shape (512, 128), expected (512, 1000000000)",)),
    (0, "vocab_size", 10**12, ("embed_tokens.weight has shape",)),
    (0, "num_hidden_layers", 10**6, ("says num_hidden_layers 1000000, but the shards hold 3 layers",)),
    (0, "n_routed_experts", 10**6, ("says n_routed_experts 1000000, but the shards hold 8 experts",)),
    (0, "moe_intermediate_size", 2**40, ("has shape",)),
    (0, "num_attention_heads", 10**8, ("has shape",)),
    (1, "num_hidden_layers", 10**6, ("says num_hidden_layers 1000000, but the shards hold 2 layers",)),
    (1, "intermediate_size", 10**9, ("has shape", "config wants")),
    (1, "head_dim", 2**30, ("has shape",)),
    (1, "block_size", 10**6, ("block_size must be in 2..max_position_embeddings",)),
])
def test_absurd_sizes_fail_on_the_headers_before_allocating(capsys, paths, monkeypatch, which, key, value, needles):
    def refuse(*a, **k):
        raise AssertionError("a model was built before its checkpoint was checked against the config")

    if which == 0:
        monkeypatch.setattr(checkpoint_module, "KimiModel", refuse)
    else:
        monkeypatch.setattr("spec.drafter_checkpoint.DFlashDrafter", refuse)
    config = paths[which] / "config.json"
    edit_json(config, (lambda d: d["text_config"].update({key: value})) if which == 0 else
              (lambda d: d.update({key: value})))
    refused(capsys, args(paths), *needles)


def test_drafter_block_past_the_target_context(capsys, paths):
    edit_json(paths[1] / "config.json", lambda d: d.update(block_size=10**6, max_position_embeddings=10**7))
    refused(capsys, args(paths), "block_size 1000000 does not fit the target's context of 64")


def test_context_past_free_memory_is_refused_with_sizes(capsys, paths):
    edit_json(paths[0] / "config.json", lambda d: d["text_config"].update(max_position_embeddings=10**12))
    edit_json(paths[1] / "config.json", lambda d: d.update(max_position_embeddings=10**12))
    refused(capsys, args(paths, "--max-new-tokens", str(10**12)), "out of memory:", "cache", "needs", "free",
            code=1)


def test_weights_past_free_memory_are_refused_with_sizes(capsys, paths, monkeypatch):
    monkeypatch.setattr(memory, "free_bytes", lambda device: 1000)
    refused(capsys, args(paths), "out of memory: the model's weights needs", "MiB on cpu, 1000 bytes free", code=1)


@pytest.mark.parametrize("error, needles", [
    (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 "
                            "GiB of which 1.00 GiB is free. Including non-PyTorch memory, this process has 78 GiB"),
     ("out of memory: CUDA out of memory. Tried to allocate 2.00 GiB.", "1.00 GiB is free.")),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you "
                  "tried to allocate 100000000000 bytes. Error code 12 (Cannot allocate memory)"),
     ("out of memory: tried to allocate 93.1 GiB on the CPU",)),
])
def test_runtime_out_of_memory_is_one_line_with_sizes(capsys, monkeypatch, error, needles):
    def oom(*a, **k):
        raise error

    monkeypatch.setattr(Engine, "generate", oom)
    refused(capsys, ["--prompt", "hi", "--max-new-tokens", "2"], *needles, code=1)


# --- tensor dtypes, shapes and values ------------------------------------------------------------------------

def replace_tensor(folder, name, tensor):
    """Replace tensor `name` in whichever shard of `folder` holds it."""
    _, shard = index_entry(folder, name)
    stored = load_file(folder / shard)
    stored[name] = tensor
    save_file(stored, folder / shard)


@pytest.mark.parametrize("which, name, make, needles", [
    (0, BODY + "layers.0.self_attn.kv_b_proj.weight", lambda t: t.to(torch.int32), ("has dtype I32",)),
    (0, BODY + "norm.weight", lambda t: t.double(), ("has dtype F64",)),
    (0, BODY + "layers.0.self_attn.o_proj.weight", lambda t: t[:, :-1].contiguous(), ("has shape (128, 127)",)),
    (0, BODY + "layers.1.mlp.experts.0.up_proj.weight_packed", lambda t: t.float(), ("has dtype F32",)),
    (1, "fc.weight", lambda t: t.to(torch.int32), ("fc.weight", "has dtype I32")),
    (1, "layers.0.self_attn.q_norm.weight", lambda t: t.to(torch.uint8), ("has dtype U8",)),
    (1, "norm.weight", lambda t: t[:-1].contiguous(), ("norm.weight", "has shape (127,)")),
])
def test_tensor_dtypes_and_shapes(capsys, paths, which, name, make, needles):
    folder = paths[which]
    _, shard = index_entry(folder, name)
    replace_tensor(folder, name, make(load_file(folder / shard)[name]))
    refused(capsys, args(paths), *needles)


@pytest.mark.parametrize("which, name", [(0, BODY + "layers.2.self_attn.q_b_proj.weight"), (1, "fc.weight")],
                         ids=["target", "drafter"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_weights_are_named(capsys, paths, which, name, value):
    folder = paths[which]
    _, shard = index_entry(folder, name)
    tensor = load_file(folder / shard)[name].clone()
    tensor.view(-1)[7] = value
    replace_tensor(folder, name, tensor)
    refused(capsys, args(paths), name, shard, "holds NaN or inf")


@pytest.mark.parametrize("damage", ["garbage", "truncated", "huge-header", "empty"])
def test_corrupt_shards_name_the_file(capsys, paths, damage):
    folder = paths[1]
    _, shard = index_entry(folder)
    data = (folder / shard).read_bytes()
    (folder / shard).write_bytes({"garbage": b"not a safetensors file at all", "truncated": data[: len(data) // 2],
                                  "huge-header": (2**62).to_bytes(8, "little") + b"{}", "empty": b""}[damage])
    refused(capsys, args(paths), shard, "is not a readable safetensors file")


def test_unexpected_and_missing_drafter_tensors(capsys, paths):
    folder = paths[1]
    name, shard = index_entry(folder)
    stored = load_file(folder / shard)
    stored["extra.weight"] = torch.zeros(2)
    save_file(stored, folder / shard)
    edit_json(folder / INDEX_FILE, lambda d: d["weight_map"].update({"extra.weight": shard}))
    refused(capsys, args(paths), "unexpected tensor 'extra.weight'")
    edit_json(folder / INDEX_FILE, lambda d: [d["weight_map"].pop(k) for k in ("extra.weight", name)])
    refused(capsys, args(paths), "missing 1 tensors", repr(name))


def test_drafter_entries_match_the_module():
    cfg = drafter_config(CFG)
    meta = {n: tuple(t.shape) for n, t in checkpoint_tensors(DFlashDrafter(cfg, torch.float32, "meta")).items()}
    assert drafter_entries(cfg) == meta


def test_non_finite_logits_stop_the_run(capsys, paths):
    """Finite weights whose logits overflow: the step's read reports them (exit 1), no token-0 stream."""
    name = "language_model.lm_head.weight"
    replace_tensor(paths[0], name, torch.full((CFG.vocab_size, CFG.hidden_size), 3e38, dtype=torch.bfloat16))
    refused(capsys, args(paths), "logits are NaN or inf", "step 0", code=1)


@pytest.mark.parametrize("spec", [True, False])
def test_library_non_finite_logits_raise(paths, spec):
    target = load_model(paths[0], dtype=torch.float32, progress=False)
    drafter = load_drafter(paths[1], target, dtype=torch.float32)
    engine = Engine(target, drafter, 4, cuda_graphs=False)
    assert len(engine.generate([[5, 6]], 6, spec=spec).output_ids[0]) == 6
    target.lm_head.weight[3, 5] = float("nan")
    with pytest.raises(NonFiniteLogits, match="logits are NaN or inf"):
        engine.generate([[5, 6]], 6, spec=spec)


@pytest.mark.parametrize("mode", [[], ["--json"]], ids=["text", "json"])
def test_interrupted_run_reports_what_it_made(capsys, monkeypatch, mode):
    """Ctrl-C (KeyboardInterrupt) after the third emission: exit 130 and a report of those tokens (the signal
    itself: test_hostile_process.py)."""
    generate = Engine.generate

    def interrupted(self, prompts, max_new_tokens, sampling=None, stop_ids=(), spec=True, on_tokens=None):
        emitted = []

        def then_stop(b, ids):
            on_tokens(b, ids)
            emitted.extend(ids)
            if len(emitted) >= 3:
                raise KeyboardInterrupt

        return generate(self, prompts, max_new_tokens, sampling, stop_ids, spec, then_stop)

    monkeypatch.setattr(Engine, "generate", interrupted)
    handler = signal.getsignal(signal.SIGINT)
    assert main(["--prompt", "hi", "--max-new-tokens", "50", *mode]) == 130
    assert signal.getsignal(signal.SIGINT) == handler
    out, err = capsys.readouterr()
    assert err == ""
    if mode:
        report = json.loads(out)
        assert report["finish_reason"] == "interrupted" and 3 <= len(report["output_ids"]) < 50
        assert report["steps"] == len(report["accept_lengths"]) >= 1
    else:
        assert out.rstrip("\n").rsplit("\n", 1)[1].endswith("interrupted) on cpu")


# --- sampling values -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("flag, value, needle", [
    ("--temperature", "nan", "--temperature must be a finite number"),
    ("--temperature", "inf", "--temperature must be a finite number"),
    ("--temperature", "-inf", "--temperature must be a finite number"),
    ("--temperature", "-0.5", "--temperature must be 0 (greedy) or at least 1e-05"),
    ("--temperature", "1e-320", "--temperature must be 0 (greedy) or at least 1e-05"),
    ("--top-p", "nan", "--top-p must be a finite number"),
    ("--top-p", "0", "--top-p must be in (0, 1]"),
    ("--top-p", "1.5", "--top-p must be in (0, 1]"),
    ("--seed", str(2**64), "--seed must be in 0..9223372036854775807"),
    ("--seed", str(10**40), "--seed must be in 0..9223372036854775807"),
    ("--seed", "-1", "--seed must be in 0.."),
    ("--seed", "1.5", "--seed"),
    ("--max-new-tokens", "0", "--max-new-tokens must be >= 1"),
    ("--max-new-tokens", "2.5", "--max-new-tokens"),
    ("--collective-timeout", "nan", "--collective-timeout: must be a positive"),
    ("--prompt-ids", "1,2.5", "--prompt-ids"),
    ("--prompt-ids", "1,-3", "outside the vocabulary of 512: [-3]"),
    ("--prompt-ids", str(2**70), "outside the vocabulary"),
    ("--prompt-ids", ",", "prompt 0 has 0 tokens"),
    ("--device", "cpu:3", "--device cpu:3"),
    ("--model-path", "/nonexistent/a\nb\x1b[2J", "/nonexistent/a\\nb\\x1b[2J is not a directory"),
])
def test_bad_values(capsys, flag, value, needle):
    prompt = ([] if flag == "--prompt-ids" else ["--prompt", "hi"]) + (["--no-spec"] if flag == "--model-path" else [])
    refused(capsys, [*prompt, f"{flag}={value}"], needle)


def test_library_sampling_values():
    for kwargs in (dict(temperature=float("nan")), dict(temperature=float("inf")), dict(top_p=float("nan")),
                   dict(seed=2**64), dict(seed=-1), dict(top_k=-1)):
        with pytest.raises(ValueError):
            SamplingParams(**kwargs)
    for kwargs in (dict(top_k=1.5), dict(seed=2.0), dict(temperature=True), dict(temperature="0.5")):
        with pytest.raises((TypeError, ValueError)):
            SamplingParams(**kwargs)
    assert SamplingParams(temperature=np.float32(0.5), seed=np.int64(3)).seed == 3


def test_sampling_values_set_after_construction_are_checked(small):
    sampling = SamplingParams(temperature=0.7)
    sampling.temperature = float("nan")
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        small[1].generate([[5, 6]], 2, sampling, spec=False)


# --- environment ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("env, needle", [
    ({"WORLD_SIZE": "2"}, "WORLD_SIZE=2 is set but RANK, MASTER_ADDR, MASTER_PORT are not"),
    ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not an integer"),
    ({"WORLD_SIZE": "0"}, "WORLD_SIZE=0 is out of range"),
    ({"WORLD_SIZE": "2", "RANK": "5", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234"}, "RANK=5 is out of range"),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "http"}, "MASTER_PORT='http'"),
    ({"SPEC_KERNELS": "moe=bogus"}, "SPEC_KERNELS='moe=bogus': unknown backend 'bogus'"),
    ({"SPEC_KERNELS": "warp=triton"}, "SPEC_KERNELS='warp=triton': unknown op 'warp'"),
    ({"SPEC_KERNELS": "moe"}, "expected op=backend"),
    ({"SPEC_KERNELS": "moe=triton"}, "moe set to triton, which needs a CUDA device"),
])
def test_environment(capsys, monkeypatch, env, needle):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    ops.apply_env()
    try:
        refused(capsys, ["--prompt", "hi", "--max-new-tokens", "2"], needle)
    finally:
        monkeypatch.undo()
        ops.apply_env()
    assert ops.env_problem() is None


def test_bad_spec_kernels_is_raised_at_use_not_at_import(monkeypatch):
    monkeypatch.setenv("SPEC_KERNELS", "attention=bogus")
    ops.apply_env()
    try:
        with pytest.raises(ValueError, match="SPEC_KERNELS='attention=bogus': unknown backend"):
            ops.rms_norm(torch.ones(2, 4), torch.ones(4), 1e-6)
    finally:
        monkeypatch.undo()
        ops.apply_env()
    assert ops.rms_norm(torch.ones(2, 4), torch.ones(4), 1e-6).shape == (2, 4)


def test_non_utf8_prompt_bytes_reach_the_byte_tokenizer(capsys):
    """Undecodable argv bytes arrive as surrogates (surrogateescape); the byte tokenizer gets the bytes back."""
    for extra in ([], ["--chat"]):
        assert main(["--prompt", "a\udcff\udcfeb", "--max-new-tokens", "2", "--json", *extra]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["prompt_tokens"] == (4 if not extra else 4 + len(ByteTokenizer(512).apply_chat_template(
            [{"role": "user", "content": ""}])))
    assert ByteTokenizer(512).encode("a\udcff\udcfeb") == [97, 255, 254, 98]
    assert ByteTokenizer(512).encode("\ud800") == list("\ufffd".encode())


# --- the library API -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small():
    """A random tiny target with a 16-token context, and its engine (target only)."""
    cfg = dataclasses.replace(preset("tiny"), max_position_embeddings=16)
    target = KimiModel(cfg, dtype=torch.float32).init_random_(0).prepare()
    return target, Engine(target, None, cuda_graphs=False)


@pytest.mark.parametrize("prompts, error, needle", [
    ([[1.0, 2.0]], TypeError, "prompt 0: token ids must be integers, got 1.0"),
    ([[1, 2.5]], TypeError, "got 2.5"),
    ([[np.float64(3)]], TypeError, "token ids must be integers"),
    ([[True, 5]], TypeError, "token ids must be integers, got True"),
    ([torch.tensor([1.0, 2.0])], TypeError, "1-D of integers, got 1-D torch.float32"),
    (torch.tensor([[1.5, 2.0]]), TypeError, "1-D of integers"),
    (torch.tensor([1, 2]), TypeError, "must be 2-D [batch, tokens]"),
    ([1, 2, 3], TypeError, "prompt 0 must be a sequence of token ids, got int"),
    ("hello", TypeError, "must be a list of token-id lists, got str"),
    (["hello"], TypeError, "prompt 0 must be a sequence of token ids, got str"),
    ([[1, 512]], ValueError, "outside the vocabulary of 512: [512]"),
    ([[-1]], ValueError, "outside the vocabulary"),
    ([[]], ValueError, "prompt 0 has 0 tokens"),
    ([], ValueError, "no prompt given"),
    ([[5] * 16], ValueError, "prompt 0 has 16 tokens; the context holds 16"),
])
def test_engine_prompts(small, prompts, error, needle):
    with pytest.raises(error) as info:
        small[1].generate(prompts, 2, spec=False)
    assert needle in str(info.value)


def test_engine_takes_integer_tensors_and_arrays(small):
    want = small[1].generate([[5, 6, 7]], 3, spec=False).output_ids
    for prompts in (torch.tensor([[5, 6, 7]]), [torch.tensor([5, 6, 7], dtype=torch.int32)], np.array([[5, 6, 7]]),
                    [(5, 6, 7)]):
        assert small[1].generate(prompts, 3, spec=False).output_ids == want


@pytest.mark.parametrize("kwargs, error, needle", [
    (dict(max_new_tokens=2.5), TypeError, "max_new_tokens must be an integer"),
    (dict(max_new_tokens=True), TypeError, "max_new_tokens must be an integer"),
    (dict(max_new_tokens=0), ValueError, "max_new_tokens must be >= 1"),
    (dict(sampling={"temperature": 0.5}), TypeError, "sampling must be a SamplingParams"),
    (dict(stop_ids=[2.5]), TypeError, "token ids must be integers"),
    (dict(on_tokens="print"), TypeError, "on_tokens must be callable"),
    (dict(spec=True), ValueError, "needs a drafter"),
    (dict(sampling=SamplingParams(seed=2**63 - 1), prompts=[[1], [2]]), ValueError, "seed"),
])
def test_engine_arguments(small, kwargs, error, needle):
    call = dict(prompts=[[5, 6]], max_new_tokens=2, spec=False)
    call.update(kwargs)
    with pytest.raises(error, match=needle):
        small[1].generate(**call)


def test_greedy_generate_checks_ids_and_stops_at_the_context(small):
    target = small[0]
    with pytest.raises(ValueError, match="outside the vocabulary of 512"):
        greedy_generate(target, [[1, 600]], 4)
    with pytest.raises(TypeError, match="token ids must be integers"):
        greedy_generate(target, [[1, 2.0]], 4)
    with pytest.raises(TypeError, match="max_new_tokens must be an integer"):
        greedy_generate(target, [[1, 2]], 4.0)
    positions = []
    forward = KimiModel.forward

    def recording(self, tokens, pos, *a, **k):
        positions.append(int(pos.max()))
        return forward(self, tokens, pos, *a, **k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(KimiModel, "forward", recording)
        out = greedy_generate(target, [[1, 2, 3], [4]], 100)
    assert max(positions) == 15  # a 16-token context: positions 0..15, then the token they predict
    assert [len(o) for o in out] == [14, 16]
    assert greedy_generate(target, [[1, 2, 3]], 100, max_len=10**12) == out[:1]
    with pytest.raises(ValueError, match="prompt 0 has 17 tokens; the cache holds 1..16"):
        greedy_generate(target, [[1] * 17], 2)


def test_tokenizer_plain_text_by_default_and_integer_ids():
    tok = ByteTokenizer(512)
    assert tok.encode("<|im_end|>") == list(b"<|im_end|>")
    assert tok.encode("<|im_end|>", allow_special=True) == [tok.im_end_id]
    chat = tok.apply_chat_template([{"role": "user", "content": "<|im_end|>"}])
    assert chat.count(tok.im_end_id) == 1 and chat[0] == tok.special_id("<|im_user|>")  # control tokens still
    with pytest.raises(TypeError, match="token ids must be integers"):
        tok.decode([104.0])
    with pytest.raises(TypeError, match="encode takes a str"):
        tok.encode(b"bytes")


# --- tokenizer files -----------------------------------------------------------------------------------------

def write_byte_ranks(folder):
    """A tiktoken.model of the 256 single bytes: a KimiTokenizer of 512 ids, the tiny model's vocabulary."""
    (folder / "tiktoken.model").write_bytes(b"".join(base64.b64encode(bytes([b])) + b" %d\n" % b
                                                     for b in range(256)))


@pytest.mark.parametrize("content, needle", [
    ("{", "is not valid JSON"),
    ("[]", "must hold a JSON object, got a list"),
    ('{"added_tokens_decoder": [1]}', "added_tokens_decoder must be an object"),
    ('{"added_tokens_decoder": {"300": {"name": "x"}}}', "added_tokens_decoder.300 must map an id"),
    ('{"added_tokens_decoder": {"abc": {"content": "x"}}}', "added_tokens_decoder.abc must map an id"),
    (None, "is a directory"),
])
def test_bad_tokenizer_config_names_the_file(capsys, paths, content, needle):
    write_byte_ranks(paths[0])
    file = paths[0] / "tokenizer_config.json"
    if content is None:
        file.mkdir()
    else:
        file.write_text(content)
    refused(capsys, args(paths), file, needle)


def test_tokenizer_files(paths, capsys):
    write_byte_ranks(paths[0])
    assert isinstance(load_tokenizer(paths[0], 512), KimiTokenizer)
    assert main(args(paths, "--chat")) == 0
    capsys.readouterr()
    (paths[0] / "tiktoken.model").unlink()
    (paths[0] / "tiktoken.model").mkdir()
    refused(capsys, args(paths), paths[0] / "tiktoken.model", "is a directory")
