"""The default model: the shipped pair fits 16 MB and loads; the target trainer's checkpoint holds what its forward
computed; the corpus, the measurements (bits per byte, chains, the parse check) on small inputs."""

import dataclasses

import pytest
import torch

import ops
from model.checkpoint import load_model
from spec.default_model import (DRAFTER_DIR, HELD_OUT, SHIPPED_TARGET, TARGET_DIR, ChainDrafter, bits_per_byte,
                                complete_prefix, corpus_stream, document_ids, evaluate, folder_bytes,
                                function_headers, load_default, parses, shipped_drafter_config, stdlib_files,
                                write_default)
from spec.drafter_checkpoint import load_drafter
from spec.train_target import TrainableTarget, fake_int4, random_windows, train_target
from tests.conftest import rel_err
from tests.test_model_vs_hf import one_thread  # noqa: F401 (autouse fixture)

# SHIPPED_TARGET's architecture (q LoRA, dense first layer, MoE with a shared expert, YaRN) at a test size
SMALL = dataclasses.replace(SHIPPED_TARGET, hidden_size=64, num_hidden_layers=3, intermediate_size=128,
                            n_routed_experts=4, moe_intermediate_size=32, num_attention_heads=2, q_lora_rank=32,
                            qk_nope_head_dim=16, v_head_dim=16)


def test_the_shipped_pair_fits_16_mb_and_loads():
    assert folder_bytes(TARGET_DIR) + folder_bytes(DRAFTER_DIR) <= 16_000_000
    target, drafter, tok = load_default()
    assert drafter.target is target and tok.vocab_size == target.cfg.vocab_size
    assert shipped_drafter_config().hidden_size == SHIPPED_TARGET.hidden_size


def test_the_shipped_shapes_are_k2_6s_architecture():
    cfg = SHIPPED_TARGET
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.first_k_dense_replace, cfg.n_shared_experts) == (512, 64, 1, 1)
    assert cfg.q_lora_rank and cfg.rope_scaling["type"] == "yarn" and cfg.quantization.group_size == 32
    assert cfg.bos_token_id == 256 and cfg.eos_token_id == 257  # the byte tokenizer's [BOS] and [EOS]


def test_fake_int4_is_the_writers_quantiser():
    from model.checkpoint import quantize_int4

    w = torch.randn(6, 64, generator=torch.Generator().manual_seed(0)).requires_grad_()
    out = fake_int4(w)
    assert torch.equal(out.detach(), quantize_int4(w.detach())[2])
    out.sum().backward()
    assert torch.equal(w.grad, torch.ones_like(w))  # straight through


def test_trained_target_loads_as_its_training_forward_computed(tmp_path):
    """A few dozen steps lower the loss; the checkpoint written afterwards, read by the normal loader, gives the
    logits of the training forward (whose weights `export` rounds to what was stored)."""
    train_files, _ = stdlib_files()
    stream = corpus_stream(train_files[:3])
    model = TrainableTarget(SMALL).init_weights_(0)
    history = train_target(model, stream, steps=30, batch=4, seq_len=64, lr=3e-3, log=lambda line: None,
                           log_every=1)
    losses = [loss for _, loss in history]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5
    assert any(moe.e_score_correction_bias.abs().sum() > 0 for moe in model.moe_layers())  # balancing moved it
    model.export(tmp_path / "t")
    loaded = load_model(tmp_path / "t", dtype=torch.float32, progress=False)
    tokens = random_windows(stream, 2, 40, seed=3)[:, :40]
    with torch.no_grad():
        ref = model(tokens)
    out = loaded(tokens, torch.arange(40).expand(2, 40), loaded.new_cache(2, 40)).logits
    assert rel_err(out, ref) < 1e-5


def test_the_corpus_holds_out_the_fixed_modules():
    train_files, held = stdlib_files()
    assert [p.relative_to(held[0].parent).as_posix() for p in held[:2]] == list(HELD_OUT[:2])
    assert not set(held) & set(train_files) and train_files == sorted(train_files)
    assert all("site-packages" not in p.parts for p in train_files)
    assert document_ids(b"ab") == [256, 97, 98, 257]
    headers = function_headers(held, 20)
    assert len(headers) == 20 and all(h.startswith("def ") and h.endswith(":\n") for h in headers)
    assert headers[0].startswith("def b64encode(")  # in turn: base64's first public function, then bisect's


@pytest.mark.parametrize("text, kept", [
    ("def f(x):\n    y = x\n    return y\n\nprint(f(1))\nwhile Tr",
     "def f(x):\n    y = x\n    return y\n\nprint(f(1))\n"),
    ('def f(x):\n    """Doc."""\n    for i in x:\n        if i:\n            pr', 'def f(x):\n    """Doc."""\n'),
    ("def f(x):\n    return (x +\n        1)\n    ret", "def f(x):\n    return (x +\n        1)\n"),
    ("def f(x):\n    '''unterminated\n    ret", ""),
    ("def f(x):\n    ret", ""),
])
def test_samples_are_cut_at_their_last_complete_statement(text, kept):
    assert complete_prefix(text) == kept
    assert parses(text) == bool(kept)


def test_chain_drafter_drafts_top1_chains():
    target, drafter, _ = load_default()
    chain = ChainDrafter(drafter)
    cache = drafter.new_cache(1, 64)
    out = target(torch.tensor([[100, 101, 102]]), torch.arange(3)[None], target.new_cache(1, 8),
                 hidden_layers=drafter.target_layer_ids)
    drafter.append_context(cache, out.hidden, torch.tensor([3], dtype=torch.int32), [3])
    logits = chain.draft(cache, torch.tensor([103]))
    L = drafter.cfg.draft_len
    tree = ops.build_tree(*ops.draft_topk(logits, L), torch.tensor([103]), L)
    assert tree.parents[0].tolist() == list(range(-1, L))
    assert tree.tokens[0, 1:].tolist() == drafter.draft(cache, torch.tensor([103]))[0].argmax(-1).tolist()


def test_bits_per_byte_scores_every_byte_once(tmp_path):
    target = load_model(write_default(tmp_path, seed=3)[0], dtype=torch.float32, progress=False)
    short, long = tmp_path / "a.py", tmp_path / "b.py"
    short.write_bytes(b"x = 1\n")
    long.write_bytes(bytes(range(32, 127)) * 2)
    bpb, count = bits_per_byte(target, [short, long], window=64, batch=3)
    assert count == 6 + 190
    ids = torch.tensor([document_ids(short.read_bytes())[:-1]])
    logp = torch.log_softmax(target(ids, torch.arange(7)[None], target.new_cache(1, 7)).logits[0, :-1], -1)
    alone, _ = bits_per_byte(target, [short], window=64)
    assert alone == pytest.approx(-logp.gather(-1, ids[0, 1:, None]).sum().item() / 6 / 0.6931471805599453)


def test_evaluate_measures_a_pair(tmp_path):
    target_dir, drafter_dir = write_default(tmp_path, seed=5)
    target = load_model(target_dir, dtype=torch.float32, progress=False)
    drafter = load_drafter(drafter_dir, target, dtype=torch.float32)
    held = [p for p in stdlib_files()[1] if p.name == "colorsys.py"]
    results = evaluate(target, drafter, held, headers=2, sample_bytes=12, budgets=(4,), log=lambda line: None)
    assert set(results["mean_accept_length"]) == {"4", "chain"}
    assert results["equal_to_target_greedy"] == {"4": 2, "chain": 2} and results["samples"] == 2
    assert results["scored_bytes"] == held[0].stat().st_size
    headers = function_headers(held, 2)
    assert [t[: len(h)] for t, h in zip(results["sample_texts"], headers)] == headers
