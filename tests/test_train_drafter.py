"""`spec.train_drafter`: its training forward equals the decoding drafter's, a few dozen steps lower the loss and
raise acceptance, the written drafter loads through the normal loader, a resumed run equals an uninterrupted one,
two gloo ranks (tensor-parallel target, FSDP drafter) train like one process, and bad input gets one error line."""

import dataclasses
import json

import pytest
import torch
import torch.multiprocessing as mp

from model.checkpoint import load_model
from model.generate import greedy_generate
from spec.default_model import TARGET, drafter_config, write_default
from spec.drafter_checkpoint import load_drafter, write_drafter_checkpoint
from spec.train_drafter import (STATE_FILE, FrozenTarget, Sequence, TrainDrafter, TrainOptions, main,
                                mean_accept_length, sample_batch, train, zlab_tensors)
from tests.conftest import free_port, gloo_rank, rel_err
from tests.test_model_vs_hf import one_thread  # noqa: F401 (autouse fixture)

DCFG = drafter_config(TARGET, block_size=5)
OPTS = dict(seq_len=96, batch_size=4, anchors=12, lr=2e-3, warmup=0.1, eval_prompts=3, eval_prompt_tokens=16,
            eval_tokens=24, eval_budget=8)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return write_default(tmp_path_factory.mktemp("target"), seed=11)[0]


@pytest.fixture(scope="module")
def target(target_dir):
    return load_model(target_dir, dtype=torch.float32, progress=False)


@pytest.fixture(scope="module")
def text(target):
    """The target's greedy continuations of random byte prompts: what a drafter for it should learn."""
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (8,), generator=gen).tolist() for _ in range(14)]
    return [p + out for p, out in zip(prompts, greedy_generate(target, prompts, OPTS["seq_len"] - 8))]


def sequences(text):
    return [Sequence(ids, [i >= 8 for i in range(len(ids))]) for ids in text]


def test_training_forward_equals_the_decoding_drafter(target, tmp_path):
    trainer = TrainDrafter(DCFG).init_weights_(1)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    write_drafter_checkpoint(tmp_path, DCFG, zlab_tensors(trainer.checkpoint_state()), dtype=torch.float32)
    drafter = load_drafter(tmp_path, target, dtype=torch.float32)
    tokens = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    anchors = torch.tensor([[3, 7, 11], [1, 14, 5]])
    with torch.no_grad():
        logits = trainer.block_logits(FrozenTarget(target, DCFG.target_layer_ids).batch_features(tokens), tokens,
                                      anchors,
                                      target.embed_tokens.weight, target.lm_head.weight)
    raw = target(tokens, torch.arange(20).expand(2, 20), target.new_cache(2, 20),
                 hidden_layers=DCFG.target_layer_ids).hidden
    for g in range(2):
        for a, s in enumerate(anchors[g].tolist()):
            cache = drafter.new_cache(1, 32)
            drafter.append_context(cache, raw[g : g + 1, :s], torch.tensor([s], dtype=torch.int32), [s])
            assert rel_err(logits[g, a], drafter.draft(cache, tokens[g, s : s + 1])[0]) < 1e-5


def test_batches_draft_only_marked_tokens_after_a_context():
    """Anchors leave a context token and draft marked tokens only; a sequence with fewer candidate anchors than
    asked repeats its first with no targets."""
    seqs = [Sequence(list(range(10, 40)), [False] * 20 + [True] * 10), Sequence([1, 2, 3], [True] * 3)]
    opts = TrainOptions(seq_len=32, batch_size=6, anchors=4)
    batch = sample_batch(seqs, opts, step=3, block_size=5, pad_id=0)
    assert torch.equal(batch.tokens, sample_batch(seqs, opts, 3, 5, 0).tokens)  # a function of the step
    for g in range(6):
        ids = batch.tokens[g].tolist()
        long = ids[0] == 10
        for a, s in enumerate(batch.anchors[g].tolist()):
            assert s >= 1 and (s + 1 >= 20 if long else s == 1)
            for k, t in enumerate(batch.targets[g, a].tolist()):
                drafted = s + 1 + k < (30 if long else 3) and (s + 1 + k >= 20 or not long) and (long or a == 0)
                assert t == (ids[s + 1 + k] if drafted else -100)


def test_a_few_dozen_steps_lower_the_loss_and_raise_acceptance(target, text, tmp_path):
    prompts = [ids[:16] for ids in text[:4]]
    opts = TrainOptions(**OPTS, steps=60, eval_every=60, save_every=60)
    untrained = TrainDrafter(DCFG).init_weights_(opts.seed).checkpoint_state()
    write_drafter_checkpoint(tmp_path / "untrained", DCFG, zlab_tensors(untrained))
    before = mean_accept_length(target, tmp_path / "untrained", prompts, 24, 8)
    result = train(target, sequences(text), prompts, DCFG, opts, tmp_path / "trained", log=lambda line: None,
                   progress=False)
    history = result["history"]
    assert sum(history[-5:]) / 5 < 0.8 * sum(history[:5]) / 5
    assert result["accept_length"] == mean_accept_length(target, tmp_path / "trained", prompts, 24, 8)
    assert result["accept_length"] > before + 0.3, (before, result["accept_length"])


class Interrupted(Exception):
    pass


def _interrupt(line):
    raise Interrupted(line)


def test_a_resumed_run_equals_an_uninterrupted_one(target, text, tmp_path):
    opts = TrainOptions(**OPTS, steps=6, eval_every=3, save_every=3)
    whole = train(target, sequences(text), [text[0][:8]], DCFG, opts, tmp_path / "a", log=lambda line: None,
                  progress=False)
    with pytest.raises(Interrupted):  # stops at step 3, after saving its state
        train(target, sequences(text), [text[0][:8]], DCFG, opts, tmp_path / "b", log=_interrupt, progress=False)
    assert torch.load(tmp_path / "b" / STATE_FILE, weights_only=True)["step"] == 3
    resumed = train(target, sequences(text), [text[0][:8]], DCFG, opts, tmp_path / "b", resume=True,
                    log=lambda line: None, progress=False)
    assert resumed["history"] == whole["history"][3:]
    a, b = (torch.load(tmp_path / d / STATE_FILE, weights_only=True) for d in "ab")
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), name
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()


def _rank(rank, port, target_dir, text, out):
    from model.parallel import Parallel

    with gloo_rank(rank, port):
        target = load_model(target_dir, Parallel.from_process_group(), dtype=torch.float32, progress=False)
        opts = TrainOptions(**OPTS, steps=3, eval_every=3, save_every=3)
        train(target, sequences(text), [text[0][:8]], DCFG, opts, out, log=lambda line: None, progress=False)


def test_two_gloo_ranks_train_like_one_process(target, target_dir, text, tmp_path):
    """The target split over two tensor-parallel ranks, the drafter FSDP-sharded over them, half the batch each."""
    opts = TrainOptions(**OPTS, steps=3, eval_every=3, save_every=3)
    train(target, sequences(text), [text[0][:8]], DCFG, opts, tmp_path / "one", log=lambda line: None,
          progress=False)
    mp.spawn(_rank, args=(free_port(), str(target_dir), text, str(tmp_path / "two")), nprocs=2, join=True)
    one, two = (torch.load(tmp_path / d / STATE_FILE, weights_only=True) for d in ("one", "two"))
    assert two["step"] == 3
    for name, tensor in one["model"].items():
        assert rel_err(two["model"][name], tensor) < 1e-5, name
    assert load_drafter(tmp_path / "two", target, dtype=torch.float32).cfg == DCFG


def cli(capsys, *argv):
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip().splitlines()
    return code, err


def test_the_command_line_writes_a_drafter_the_normal_loader_reads(target, target_dir, text, tmp_path, capsys):
    data = tmp_path / "data.jsonl"
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok " * 30}]}
    data.write_text("\n".join(json.dumps({"text": bytes(i for i in ids[8:] if i < 256).decode("latin-1")})
                              for ids in text)
                    + "\n" + json.dumps(chat) + "\n")
    plain = tmp_path / "plain.txt"
    plain.write_text("def f(x):\n    return x\n" * 20)
    code, err = cli(capsys, "--model-path", target_dir, "--data", data, plain, "--out", tmp_path / "out",
                    "--layers", 1, "--block-size", 4, "--heads", 2, "--steps", 4, "--batch-size", 2,
                    "--seq-len", 64, "--anchors", 4, "--eval-prompts", 2, "--eval-tokens", 8, "--eval-every", 4)
    assert code == 0, err
    drafter = load_drafter(tmp_path / "out", target, dtype=torch.float32)
    assert drafter.cfg.block_size == 4 and drafter.cfg.num_hidden_layers == 1
    assert drafter.cfg.mask_token_id == 263 and drafter.cfg.target_layer_ids == (1,)  # [UNK]; z-lab's spread


@pytest.mark.parametrize("case, message", [
    ("hidden", "drafter config does not fit the target: drafter hidden_size 64"),
    ("layers", "target_layer_ids [7] out of range"),
    ("empty", "--data: no document has a drafted token"),
    ("missing", "--data: cannot read"),
    ("json", "line 2: not JSON"),
    ("record", "line 1: want an object with a 'text' string or a 'messages' list"),
    ("block", "block size 4096: the target's context of 4096 positions cannot verify"),
    ("seq", "block size 8 does not fit --seq-len 8"),
    ("batch", "--batch-size must be >= 1"),
])
def test_bad_input_gets_one_error_line(target_dir, tmp_path, capsys, case, message):
    data = tmp_path / "data.txt"
    data.write_text("some text " * 20)
    argv = ["--model-path", target_dir, "--data", data, "--out", tmp_path / "out"]
    if case == "hidden":
        bad = dataclasses.replace(drafter_config(TARGET), hidden_size=64, head_dim=16)
        (tmp_path / "cfg").mkdir()
        (tmp_path / "cfg" / "config.json").write_text(json.dumps(bad.to_hf()))
        argv += ["--drafter-config", tmp_path / "cfg"]
    elif case == "layers":
        argv += ["--target-layer-ids", "0,7"]
    elif case == "empty":
        data.write_text("")
    elif case == "missing":
        argv[3] = tmp_path / "nowhere.txt"
    elif case in ("json", "record"):
        data = tmp_path / "data.jsonl"
        data.write_text('{"text": "a b c"}\n{oops\n' if case == "json" else '[1, 2]\n')
        argv[3] = data
    elif case == "block":
        argv += ["--block-size", 4096, "--seq-len", 5000]
    elif case == "seq":
        argv += ["--seq-len", 8]
    elif case == "batch":
        argv += ["--batch-size", 0]
    code, err = cli(capsys, *argv)
    assert code == 2
    assert [line for line in err if line.startswith("error:")] == err[-1:], err  # after the loading bar, if any
    assert message in err[-1], err[-1]


def test_the_readme_memory_plan_is_the_recipes(tmp_path, capsys):
    """The README's per-rank table for K2.6 on eight GPUs is what --memory-plan prints for its flags; the target
    shard is the loader's own buffers."""
    import re

    from model.checkpoint_writer import hf_config
    from model.config import preset
    from tests.test_ci import ROOT

    (tmp_path / "config.json").write_text(json.dumps(hf_config(preset("kimi-k2.6"))))
    assert main(["--model-path", str(tmp_path), "--memory-plan", "8", "--seq-len", "4096", "--anchors", "256",
                 "--batch-size", "8"]) == 0
    printed = [float(v) for v in re.findall(r"([0-9.]+) GiB", capsys.readouterr().out)]
    assert len(printed) == 9  # eight parts and the total
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("| per rank (`--memory-plan 8`"):]
    assert [float(v) for v in re.findall(r"\| ([0-9.]+) \|", table)[: len(printed)]] == printed
    assert "--seq-len 4096 --anchors 256 --batch-size 8" in readme
