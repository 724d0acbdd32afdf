"""CUDA-graph groundwork on the CPU: bucket choice, tree padding (a padded verify gives the real nodes the
same logits, features and accepted path: torch backend, tiny model), static buffers and the replay's input
padding, the eligibility rule, and the step benchmark's model building and floor arithmetic."""

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import ops
from model.config import preset
from model.model import KimiModel
from model.parallel import Parallel
from spec.graphs import (DEFAULT_BUCKETS, DraftGraphs, StaticBuffers, StepGraphs, bucket_for, draft_eligibility,
                         eligibility, parse_buckets, self_mask)
from tests.conftest import rel_err, requires_gpu

_spec = importlib.util.spec_from_file_location("bench_step", Path(__file__).parents[1] / "bench" / "bench_step.py")
bench_step = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_step)

TORCH = dict(attention="torch", absorb_query="torch", moe="torch", draft_topk="torch", tree_build="torch",
             accept="torch", compact="torch")


def test_bucket_for():
    """The smallest bucket that holds the budget; None past the largest (the default ladder included)."""
    for n in range(DEFAULT_BUCKETS[-1] + 1):
        assert bucket_for(n) == min(b for b in DEFAULT_BUCKETS if b >= n)
    assert DEFAULT_BUCKETS[0] == 0 and bucket_for(DEFAULT_BUCKETS[-1] + 1) is None
    assert bucket_for(5, (4, 12)) == 12 and bucket_for(0, (4, 12)) == 4 and bucket_for(13, (4, 12)) is None
    assert parse_buckets("32, 8,0,8") == (0, 8, 32)
    for bad in ("", "a,1", "-1,4"):
        with pytest.raises(ValueError):
            parse_buckets(bad)


@pytest.fixture(scope="module")
def tiny():
    """The tiny preset at TP2 (one rank alone), fp32 on the CPU, built by the benchmark's own code."""
    with ops.using(moe="torch"):
        model = bench_step.build_target("tiny", tp=2, dtype=torch.float32, device="cpu", seed=3)
    return model, bench_step.build_drafter(model, bench_step.DFLASH_TINY)


def prefilled(model, lengths, max_len=128, seed=0):
    """A cache whose rows hold random prompts of the given lengths."""
    gen = torch.Generator().manual_seed(seed)
    cache = model.new_cache(len(lengths), max_len)
    for b, n in enumerate(lengths):
        row = cache.row(b)
        tokens = torch.randint(0, model.cfg.vocab_size, (1, n), generator=gen)
        model(tokens, torch.arange(n)[None], row)
    cache.lens.copy_(torch.tensor(lengths, dtype=torch.int32))
    cache.set_host_lens(lengths)
    return cache


def clone_cache(cache):
    other = type(cache)(cache.kv.shape[0], cache.batch, cache.max_len, cache.kv.shape[-1], cache.kv.dtype, "cpu")
    other.kv.copy_(cache.kv)
    other.lens.copy_(cache.lens)
    other.set_host_lens(cache.host_lens)
    return other


def random_tree(B, L, V, budget, seed):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, L, V, generator=gen) * 3
    lp, tok = ops.draft_topk(logits, min(budget, V))
    return ops.build_tree(lp, tok, torch.randint(0, V, (B,), generator=gen), budget)


def pad_mask(mask, nodes):
    """A packed tree mask [B, T, W] padded to [B, nodes, words(nodes)]: old rows keep their bits, new rows see
    only themselves."""
    B, T, W = mask.shape
    out = self_mask(B, nodes, mask.device)
    out[:, :T] = 0
    out[:, :T, :W] = mask
    return out


def pad_tree(tree, budget):
    """The padding a verify replayed in a larger bucket gets (what `StepGraphs.load` writes): the tree padded
    to budget + 1 nodes (token 0, parent -1, depth 0, no children, mask self only); num_nodes and max_depth
    unchanged. A tree already of that size is returned as is."""
    B, T = tree.tokens.shape
    nodes = budget + 1
    if nodes < T:
        raise ValueError(f"pad_tree: a tree of {T} nodes does not fit budget {budget}")
    if nodes == T:
        return tree
    extra = nodes - T

    def fill(x, value):
        return torch.cat([x, torch.full((B, extra), value, dtype=x.dtype, device=x.device)], 1)

    return type(tree)(tokens=fill(tree.tokens, 0), parents=fill(tree.parents, -1), depths=fill(tree.depths, 0),
                      mask=pad_mask(tree.mask, nodes), first_child=fill(tree.first_child, -1),
                      next_sibling=fill(tree.next_sibling, -1), num_nodes=tree.num_nodes, max_depth=tree.max_depth)


def test_pad_tree_fields():
    with ops.using(**TORCH):
        tree = random_tree(2, 3, 50, 20, seed=1)
    padded = pad_tree(tree, 40)
    assert padded.tokens.shape == (2, 41) and padded.mask.shape == (2, 41, 2)
    assert torch.equal(padded.tokens[:, :21], tree.tokens) and not padded.tokens[:, 21:].any()
    assert (padded.parents[:, 21:] == -1).all() and not padded.depths[:, 21:].any()
    assert (padded.first_child[:, 21:] == -1).all() and (padded.next_sibling[:, 21:] == -1).all()
    assert torch.equal(padded.num_nodes, tree.num_nodes) and padded.max_depth == tree.max_depth
    dense = ops.tree_mask_dense(padded.mask, 41)
    assert torch.equal(dense[:, :21, :21], ops.tree_mask_dense(tree.mask, 21)) and not dense[:, :21, 21:].any()
    assert torch.equal(dense[:, 21:], torch.eye(41, dtype=torch.bool)[21:].expand(2, 20, 41))
    assert pad_tree(tree, 20) is tree
    with pytest.raises(ValueError):
        pad_tree(tree, 19)


def follow_first_child(tree, V, seed):
    """Target logits whose argmax at every node is its first child's token (deep paths), random elsewhere."""
    B, N1 = tree.tokens.shape
    logits = torch.randn(B, N1, V, generator=torch.Generator().manual_seed(seed))
    fc = tree.first_child.long()
    b, n = torch.nonzero(fc >= 0, as_tuple=True)
    logits[b, n, tree.tokens[b, fc[b, n]]] = 30.0
    return logits


@pytest.mark.parametrize("budget,bucket", [(5, 8), (20, 40)])
def test_padding_equivalence(tiny, budget, bucket):
    """Padded verify = unpadded verify on the real nodes (logits, features, cache entries), and acceptance on
    the padded tree walks the same path (greedy on the model's logits, greedy and T=1 on deep-path logits)."""
    model, drafter = tiny
    V = model.lm_head.weight.shape[0]
    layers = drafter.target_layer_ids
    with ops.using(**TORCH):
        tree = random_tree(2, 3, V, budget, seed=budget)
        padded = pad_tree(tree, bucket)
        cache = prefilled(model, [9, 17])
        other = clone_cache(cache)
        T = budget + 1
        out = model(tree.tokens, cache.lens[:, None].long() + tree.depths.long(), cache, tree.mask,
                    hidden_layers=layers)
        pout = model(padded.tokens, other.lens[:, None].long() + padded.depths.long(), other, padded.mask,
                     hidden_layers=layers)
        assert rel_err(pout.logits[:, :T], out.logits) < 1e-6
        assert rel_err(pout.hidden[:, :T], out.hidden) < 1e-6
        for b, n in enumerate([9, 17]):
            assert rel_err(other.kv[:, b, : n + T], cache.kv[:, b, : n + T]) < 1e-6
        seeds = torch.tensor([5, 6])
        cases = [(out.logits, pout.logits, 0.0)]
        deep = follow_first_child(tree, V, seed=1)
        deep_padded = torch.cat([deep, torch.randn(2, bucket - budget, V) * 30], 1)
        cases += [(deep, deep_padded, 0.0), (deep, deep_padded, 1.0)]
        for logits, plogits, temperature in cases:
            want = ops.accept(tree, logits, temperature, seeds=seeds, step=4)
            got = ops.accept(padded, plogits, temperature, seeds=seeds, step=4)
            assert all(torch.equal(w, g) for w, g in zip(want, got))
        assert ops.accept(padded, deep_padded, 0.0)[1].max() > 2  # the deep case does walk deep


def test_static_buffers():
    bufs = StaticBuffers(batch=2, max_nodes=129, vocab=50, features=12, logits_dtype=torch.float16,
                         hidden_dtype=torch.float32, device="cpu")
    assert bufs.tokens.shape == (2 * 129,) and bufs.mask.shape == (2 * 129 * 5,)
    assert bufs.logits.shape == (2 * 129 * 50,) and bufs.hidden.shape == (2 * 129 * 12,)
    for nodes, words in ((1, 1), (9, 1), (33, 2), (129, 5)):
        tokens, positions, mask, logits, hidden = bufs.views(nodes)
        assert tokens.shape == positions.shape == (2, nodes) and mask.shape == (2, nodes, words)
        assert logits.shape == (2, nodes, 50) and logits.dtype == torch.float16 and hidden.shape == (2, nodes, 12)
        for view, flat in ((tokens, bufs.tokens), (mask, bufs.mask), (logits, bufs.logits), (hidden, bufs.hidden)):
            assert view.is_contiguous() and view.data_ptr() == flat.data_ptr()
    assert StaticBuffers(1, 9, 50, 0, torch.float32, torch.float32, "cpu").views(9)[4] is None


def test_step_graphs_inputs_and_eager_fallback(tiny):
    """On the CPU nothing is captured: verify runs the forward as is; `load` writes the padded tree."""
    model, drafter = tiny
    with ops.using(**TORCH):
        cache = prefilled(model, [4, 6])
        graphs = StepGraphs(model, cache, 2, (0, 8, 16), drafter.target_layer_ids)
        assert graphs.bufs.max_nodes == 17 and graphs.bufs.views(17)[2].shape == (2, 17, 1)
        assert graphs.bucket(6, False) is None  # nothing captured: eager
        graphs.graphs = dict.fromkeys((0, 8, 16))  # pretend all three were captured, to test the choice
        assert [graphs.bucket(T, False) for T in (1, 2, 9, 10, 17, 18)] == [0, 8, 8, 16, 16, None]
        assert graphs.bucket(1, True) == 0 and graphs.bucket(5, True) is None
        tree = random_tree(2, 3, model.lm_head.weight.shape[0], 6, seed=2)
        positions = cache.lens[:, None].long() + tree.depths.long()
        graphs.load(8, tree.tokens, positions, tree.mask)
        tokens, s_pos, mask, _, _ = graphs.bufs.views(9)
        padded = pad_tree(tree, 8)
        assert torch.equal(tokens, padded.tokens) and torch.equal(mask, padded.mask)
        assert torch.equal(s_pos, cache.lens[:, None].long() + padded.depths.long())
        graphs.graphs = {}
        other = clone_cache(cache)
        got = graphs.verify(tree.tokens, positions, tree.mask)
        want = model(tree.tokens, positions, other, tree.mask, hidden_layers=drafter.target_layer_ids)
        assert torch.equal(got.logits, want.logits) and torch.equal(got.hidden, want.hidden)


def fake_cuda_model(joined=False):
    return SimpleNamespace(device=torch.device("cuda"), dtype=torch.bfloat16, par=SimpleNamespace(joined=joined))


def test_eligibility(tiny):
    ok, why = eligibility(tiny[0])
    assert not ok and "CUDA" in why
    assert eligibility(fake_cuda_model()) == (True, "")
    with ops.using(moe="torch"):
        ok, why = eligibility(fake_cuda_model())
        assert not ok and "moe" in why
    with ops.using(attention="torch", absorb_query="torch"):
        ok, why = eligibility(fake_cuda_model())
        assert not ok and "attention, absorb_query" in why
    assert not eligibility(fake_cuda_model(joined=True))[0]
    chain = torch.ones(3, 3, dtype=torch.bool).tril()
    expect = torch.eye(40, dtype=torch.bool)  # padded rows see themselves only
    expect[:3, :3] = chain
    assert torch.equal(ops.tree_mask_dense(pad_mask(ops.pack_tree_mask(chain[None]), 40), 40)[0], expect)


def test_floor_arithmetic(tiny):
    model, drafter = tiny
    cfg = model.cfg
    assert bench_step.expert_bytes(preset("kimi-k2.6"), 8) == 3 * 7168 * 256 // 2 + 3 * 7168 * 256 // 32 * 2
    assert bench_step.expected_distinct(384, 8, 1) == pytest.approx(8)
    assert bench_step.expected_distinct(8, 2, 1000) == pytest.approx(8)
    with ops.using(**TORCH):
        cache = prefilled(model, [5])
        tokens = torch.randint(0, cfg.vocab_size, (1, 4))
        experts = bench_step.count_experts(model, tokens, cache.lens[:, None].long() + torch.arange(4), cache)
    assert len(experts) == len(model.moe_layers()) == 2
    assert all(cfg.num_experts_per_tok <= e <= min(cfg.n_routed_experts, 4 * cfg.num_experts_per_tok)
               for e in experts)
    parts = bench_step.floor_bytes(model, batch=1, nodes=4, context=100, distinct=experts)
    H, D, R = 2, cfg.hidden_size, cfg.kv_lora_rank  # 4 heads over TP2
    attn = (cfg.q_lora_rank * D + cfg.q_lora_rank + H * 96 * cfg.q_lora_rank + 576 * D + R + H * 64 * R
            + D * H * 32) * 3 * 4
    assert parts["attention"] == attn
    shared = 3 * D * 32 * 4  # gate, up, down of the shared expert: intermediate 64 / TP2
    dense_mlp = 3 * D * 128 * 4  # layer 0's dense MLP: 256 / TP2
    router = (cfg.n_routed_experts * D + cfg.n_routed_experts) * 4
    assert parts["dense"] == (2 * D * 3 + D) * 4 + dense_mlp + 2 * (shared + router)
    assert parts["experts"] == sum(experts) * (3 * D * 32 // 2 + 3 * D * 32 // 32 * 2)
    assert parts["kv"] == 3 * 104 * 576 * 4
    assert parts["lm_head"] == 256 * D * 4 and parts["logits"] == 4 * 256 * 4
    draft = bench_step.drafter_floor_bytes(drafter, batch=1, context=100)
    assert draft["kv"] == 2 * 1 * (100 + 4) * 1 * 32 * 4  # K and V, one layer, 1 of 2 key/value heads at TP2
    assert draft["logits"] == 3 * 256 * 4
    assert draft["weights"] == sum(b.numel() * 4 for n, b in drafter.named_buffers() if n != "inv_freq")


def test_k26_tp8_rank_sizes():
    """One TP8 rank of K2.6 at its real shapes (meta tensors): ~69 GB of weights, the floor's parts."""
    model = KimiModel(preset("kimi-k2.6"), Parallel(8, 0), torch.bfloat16, "meta")
    total = sum(b.numel() * b.element_size() for b in model.state_dict(keep_vars=True).values())
    assert 60e9 < total < 80e9
    parts = bench_step.floor_bytes(model, batch=1, nodes=33, context=4096, distinct=120)
    assert parts["experts"] == 60 * 120 * bench_step.expert_bytes(model.cfg, 8)
    assert parts["kv"] == 61 * (4096 + 33) * 576 * 2
    assert parts["lm_head"] == 163840 // 8 * 7168 * 2


@pytest.fixture(scope="module")
def gpu_pair():
    from spec.default_model import load_default

    target, drafter, _ = load_default(dtype=torch.float16, device="cuda")
    return target, drafter


@requires_gpu
def test_replay_matches_eager_gpu(gpu_pair):
    """A replayed verify (padded to its bucket) gives the real nodes the eager pass's logits and features."""
    target, drafter = gpu_pair
    assert eligibility(target) == (True, "")
    cache = target.new_cache(2, 256)
    cache.lens.copy_(torch.tensor([30, 50], dtype=torch.int32, device="cuda"))
    cache.set_host_lens([30, 50])
    other = target.new_cache(2, 256)
    graphs = StepGraphs(target, cache, 2, (0, 8, 16), drafter.target_layer_ids, log=lambda line: None).capture()
    for budget in (1, 5, 8, 13):
        tree = random_tree(2, 3, target.cfg.vocab_size, budget, seed=budget)
        tree = type(tree)(*(t.cuda() if torch.is_tensor(t) else t for t in vars(tree).values()))
        for c in (cache, other):
            gen = torch.Generator("cuda").manual_seed(0)
            c.kv.copy_(torch.randn(c.kv.shape, generator=gen, device="cuda") * 0.1)
        other.lens.copy_(cache.lens)
        other.set_host_lens(cache.host_lens)
        positions = cache.lens[:, None].long() + tree.depths.long()
        got = graphs.verify(tree.tokens, positions, tree.mask)
        want = target(tree.tokens, positions, other, tree.mask, hidden_layers=drafter.target_layer_ids)
        assert rel_err(got.logits, want.logits) < 1e-2 and rel_err(got.hidden, want.hidden) < 1e-2
    tokens = torch.tensor([[3], [4]], device="cuda")
    got = graphs.verify(tokens, cache.lens[:, None].long(), None)
    assert rel_err(got.logits, target(tokens, other.lens[:, None].long(), other).logits) < 1e-2


@requires_gpu
@pytest.mark.parametrize("budget", (4, 8, 13, 40, 200))
def test_greedy_with_graphs_equals_without_gpu(gpu_pair, budget):
    """Greedy outputs with graphs equal those without, speculative (a bucket per budget; 200 is past the
    buckets: eager) and target-only, for a batch of prompts of different lengths."""
    from spec.engine import Engine

    target, drafter = gpu_pair
    prompts = [[257, 84, 104, 101, 32, 116], [7], list(range(40, 63))]
    for spec in (True, False):
        runs = [Engine(target, drafter, budget, cuda_graphs=g).generate(prompts, 48, spec=spec).output_ids
                for g in (True, False)]
        assert runs[0] == runs[1]


@requires_gpu
@pytest.mark.parametrize("budget", (8, "auto"))
def test_second_run_captures_nothing_gpu(gpu_pair, budget):
    """An engine's second generate (another prompt length, a shorter run) replays the first's verify and draft
    graphs (no capture inside its decode) and, at a fixed budget, gives a fresh engine's tokens (auto's choices
    follow each engine's own latency table, so its trees may differ)."""
    from spec.engine import Engine

    target, drafter = gpu_pair
    captures = []
    engine = Engine(target, drafter, budget)
    engine.graph_log = captures.append
    engine.generate([[257, 84, 104, 101, 32, 116]], 48)
    first = len(captures)
    again = engine.generate([list(range(40, 63))], 32).output_ids
    assert first > 0 and len(captures) == first, captures[first:]
    if budget != "auto":
        assert again == Engine(target, drafter, budget).generate([list(range(40, 63))], 32).output_ids


def test_bench_step_pieces_on_cpu(tiny):
    """The benchmark's step closures and report on the tiny model (eager: nothing is captured on the CPU)."""
    model, drafter = tiny
    with ops.using(**TORCH):
        bench = bench_step.Bench(model, drafter, (0, 8), max_context=64)
        bench.set_context(20)
        nxt = bench.spec_step(8)()
        assert torch.equal(bench.spec_step(8, graphed=False)(), nxt)
        assert nxt.shape == (1,) and bench.dcache.lens.tolist() == [20] and bench.cache.lens.tolist() == [20]
        assert bench.ar_step()().shape == (1,)
        tokens, positions, mask = bench.verify_inputs(8)
        assert tokens.shape == (1, 9) and mask.shape == (1, 9, 1) and positions.min().item() == 20
    row = dict(context=20, budget=8, distinct_experts=3.0, floor_ms=1.0, verify_eager_ms=3.0, verify_graph_ms=1.2,
               verify_kernels_ms=1.1, overhead_removed=0.95, graph_over_kernels=1.09, verify_graph_over_floor=1.2,
               step_eager_ms=4.0, step_ms=2.0, step_over_floor=1.5)
    meta = dict(gpu="cpu", date="now", torch="t", triton="t", read_GBps=1.0, build_s=1.0, capture_s=0.5,
                drafter_note="n")
    table = bench_step.markdown(meta, [row, dict(row, budget=0, ar_step_ms=1.0, ar_step_over_floor=1.0)])
    assert table.count("\n| 20 |") == 2 and "95%" in table


def test_engine_graph_bucket(capsys, tiny):
    """The engine's choice: the bucket of its budget (0 for target-only) on CUDA (graphs are on by default), None
    on the CPU, with graphs off, or past the buckets (one notice)."""
    from spec.engine import Engine

    assert Engine(tiny[0], budget=8).graph_bucket(True) is None
    fake = fake_cuda_model()
    on = dict(cuda_graphs=True)
    assert Engine(fake, budget=40).graph_bucket(True) == 64 and Engine(fake, budget=40, **on).graph_bucket(False) == 0
    assert Engine(fake, budget=8, cuda_graphs=False).graph_bucket(True) is None
    assert capsys.readouterr().err == ""
    engine = Engine(fake, budget=200, **on)
    assert engine.graph_bucket(True) is None and engine.graph_bucket(True) is None
    assert capsys.readouterr().err.count("cuda graphs off") == 1
    with ops.using(moe="torch"):
        assert Engine(fake, budget=8, **on).graph_bucket(True) is None
        assert "moe" in capsys.readouterr().err


def test_draft_graphs_body_on_cpu(tiny):
    """The captured draft body over a span rounded up to its bucket builds the eager pass's tree."""
    model, drafter = tiny
    assert not draft_eligibility(drafter)[0] and not draft_eligibility(SimpleNamespace())[0]
    with ops.using(**TORCH):
        dcache = drafter.new_cache(2, 100)
        feats = torch.randn(2, 30, len(drafter.target_layer_ids) * model.cfg.hidden_size)
        drafter.append_context(dcache, feats, torch.tensor([20, 5], dtype=torch.int32), [20, 5])
        drafts = DraftGraphs(drafter, dcache, 2, 6, granularity=16)
        assert drafts.span() == 32  # 20 + block 4, rounded up to 16s
        dcache.set_host_lens([95, 5])
        assert drafts.span() == 100  # clamped to the cache
        dcache.set_host_lens([20, 5])
        bonus = torch.tensor([3, 9])
        drafts.bonus.copy_(bonus)
        drafts.run_static(drafts.span())
        got = ops.Tree(**drafts.outputs, max_depth=drafts.max_depth)
        logits = drafter.draft(dcache, bonus)
        lp, tok = ops.draft_topk(logits, 6)
        want = ops.build_tree(lp, tok, bonus, 6)
        for name, t in vars(want).items():
            assert t == getattr(got, name) if name == "max_depth" else torch.equal(t, getattr(got, name)), name
        assert dcache.lens.tolist() == [20, 5] and dcache.host_lens == [20, 5]


def test_decode_flag():
    from spec.decode import parse_args

    assert not parse_args(["--prompt", "hi", "--no-cuda-graphs"]).cuda_graphs
    assert parse_args(["--prompt", "hi", "--cuda-graphs"]).cuda_graphs
    assert parse_args(["--prompt", "hi"]).cuda_graphs  # on by default (a no-op without CUDA)
