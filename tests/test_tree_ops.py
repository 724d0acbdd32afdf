"""DDTree ops: the default backend (torch on CPU, Triton on a GPU) against the plain-Python heapq/walk reference,
the Triton kernels against the torch references (exact for integer outputs), degenerate trees, and the sm_120
compile check."""

import pytest
import torch

import ops
from ops.attention import tree_mask_dense
from ops.tree import Tree, sampling_floor
from tests.tree_ref import build_tree_heapq, tree_visibility, walk
from tests.conftest import compiled_in_child, gpu, requires_triton

TREE_FIELDS = ("tokens", "parents", "depths", "mask", "first_child", "next_sibling", "num_nodes")


def device():
    return "cuda" if gpu() else "cpu"


def random_draft(B, L, K, gen, ties=True, vocab=1000):
    """Descending per-depth log-probs (from a small grid when `ties`, so equal cumulative sums are common)."""
    if ties:
        lp = -torch.randint(0, 5, (B, L, K), generator=gen).float() * 0.25
    else:
        lp = torch.log_softmax(torch.randn(B, L, vocab, generator=gen) * 3, -1)[..., :K]
    lp = lp.sort(-1, descending=True).values
    tokens = torch.stack([torch.randperm(vocab, generator=gen)[:K] for _ in range(B * L)]).view(B, L, K)
    roots = torch.randint(0, vocab, (B,), generator=gen)
    return lp.to(device()), tokens.to(device()), roots.to(device())


def check_against_heapq(tree, lp, tokens, roots, budget):
    B, N1 = tree.tokens.shape
    dense = tree_mask_dense(tree.mask, N1).cpu()
    t = {f: getattr(tree, f).cpu() for f in TREE_FIELDS}
    for b in range(B):
        ref_tok, ref_par, ref_dep = build_tree_heapq(lp[b].cpu(), tokens[b].cpu().tolist(), int(roots[b]), budget)
        n = len(ref_tok)
        assert int(t["num_nodes"][b]) == n
        assert t["tokens"][b, :n].tolist() == ref_tok
        assert t["parents"][b, :n].tolist() == ref_par
        assert t["depths"][b, :n].tolist() == ref_dep
        assert not t["tokens"][b, n:].any() and (t["parents"][b, n:] == -1).all() and not t["depths"][b, n:].any()
        parents = t["parents"][b].tolist()
        for i in range(N1):
            kids, c = [], int(t["first_child"][b, i])
            while c >= 0:
                kids.append(c)
                c = int(t["next_sibling"][b, c])
            assert kids == [j for j in range(N1) if parents[j] == i], (b, i)
        assert torch.equal(dense[b], tree_visibility(parents))


@pytest.mark.parametrize("budget,batch", [(1, 64), (2, 64), (3, 64), (7, 64), (17, 48), (64, 32), (130, 12),
                                          (512, 4)], ids=lambda v: str(v))
@pytest.mark.parametrize("ties", [True, False], ids=["ties", "distinct"])
def test_build_matches_heapq(budget, batch, ties):
    gen = torch.Generator().manual_seed(budget * 2 + ties)
    for L, K in [(1, 1), (3, 2), (7, min(budget, 1000)), (15, min(budget, 8)), (4, 5)]:
        lp, tokens, roots = random_draft(batch, L, K, gen, ties)
        check_against_heapq(ops.build_tree(lp, tokens, roots, budget), lp, tokens, roots, budget)


def test_build_batched_equals_unbatched():
    gen = torch.Generator().manual_seed(5)
    lp, tokens, roots = random_draft(6, 7, 9, gen)
    batched = ops.build_tree(lp, tokens, roots, 25)
    for b in range(6):
        one = ops.build_tree(lp[b:b + 1], tokens[b:b + 1], roots[b:b + 1], 25)
        for f in TREE_FIELDS:
            assert torch.equal(getattr(one, f)[0], getattr(batched, f)[b]), f


def test_chain_and_padding():
    """K = 1: the tree is the chain of per-depth argmaxes; budget past L + its nodes is padding."""
    gen = torch.Generator().manual_seed(1)
    lp, tokens, roots = random_draft(3, 5, 1, gen)
    tree = ops.build_tree(lp, tokens, roots, 9)
    assert tree.num_nodes.tolist() == [6, 6, 6]
    assert torch.equal(tree.tokens[:, 1:6], tokens[:, :, 0]) and not tree.tokens[:, 6:].any()
    assert tree.parents[0].tolist() == [-1, 0, 1, 2, 3, 4, -1, -1, -1, -1]
    assert tree.first_child[0].tolist() == [1, 2, 3, 4, 5, -1, -1, -1, -1, -1]
    dense = tree_mask_dense(tree.mask, 10)[0].cpu()
    assert torch.equal(dense[:6, :6], torch.ones(6, 6, dtype=torch.bool).tril())
    assert torch.equal(dense[6:], torch.eye(10, dtype=torch.bool)[6:])


def force_build(monkeypatch, method):
    """Make the Triton tree build use the heap loop or the depth-synchronous build at every budget."""
    from triton_kernels import ddtree as dd

    for cfg in dd.CONFIGS.values():
        monkeypatch.setitem(cfg, "levels_from", 1 if method == "levels" else dd.MAX_BUDGET + 1)


@requires_triton
@pytest.mark.parametrize("method", ["heap", "levels"])
@pytest.mark.parametrize("budget,batch,L,K", [(1, 8, 3, 4), (5, 16, 4, 3), (17, 12, 15, 17), (63, 4, 7, 63),
                                              (512, 1, 15, 512)], ids=lambda v: str(v))
def test_build_triton_matches_torch(budget, batch, L, K, method, monkeypatch):
    gen = torch.Generator().manual_seed(budget)
    lp, tokens, roots = random_draft(batch, L, K, gen, ties=budget != 63)
    ref = ops.build_tree(lp, tokens, roots, budget)
    force_build(monkeypatch, method)
    with ops.using(tree_build="triton"):
        out = ops.build_tree(lp, tokens, roots, budget)
    for f in TREE_FIELDS:
        assert torch.equal(getattr(out, f), getattr(ref, f)), f


@requires_triton
@pytest.mark.parametrize("ties", [True, False], ids=["ties", "distinct"])
def test_levels_build_matches_heapq(ties, monkeypatch):
    """The depth-synchronous build against heapq on many small trees: equal scores across depths and parents,
    zero log-probs (a child tying its parent), several candidate batches per round, K and L running out."""
    gen = torch.Generator().manual_seed(11 + ties)
    force_build(monkeypatch, "levels")
    for budget, L, K in [(2, 3, 2), (9, 2, 9), (13, 5, 4), (24, 3, 24), (40, 2, 3)]:
        lp, tokens, roots = random_draft(12, L, K, gen, ties)
        with ops.using(tree_build="triton"):
            tree = ops.build_tree(lp, tokens, roots, budget)
        check_against_heapq(tree, lp, tokens, roots, budget)


def topk_rows(gen, V):
    """Rows of random logits, of ties (about V/2 at the K-th value), of equal top values in the last chunk, and
    of one value (all tie: the K lowest ids)."""
    logits = torch.randn(4, V, generator=gen) * 3
    logits[1] = torch.randint(0, 2, (V,), generator=gen).float()
    logits[2, V - 700:] = 20.0
    logits[3] = -1.5
    return logits[None]


@requires_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_draft_topk_triton_ties_and_chunks(dtype):
    """Several chunks per row: ties at the K-th value across chunks, winners all in one chunk."""
    logits = topk_rows(torch.Generator().manual_seed(3), 5000).to(device=device(), dtype=dtype)
    ref = ops.tree.draft_topk_torch(logits, 70)
    with ops.using(draft_topk="triton"):
        lp, tok = ops.draft_topk(logits, 70)
    assert torch.equal(tok, ref[1]) and (lp - ref[0]).abs().max() < 1e-5


@requires_triton
@pytest.mark.parametrize("k,chunk,tile,merge", [(5, 1024, 256, 8192), (200, 512, 128, 1024), (300, 1024, 256, 2048),
                                                (1000, 1024, 1024, 8192)], ids=lambda v: str(v))
def test_draft_topk_triton_tiles(k, chunk, tile, merge, monkeypatch):
    """Chunks scanned in several tiles, merges over several tiles, chunks grown to fit the merge, K = V."""
    from triton_kernels import ddtree as dd

    for cfg in dd.CONFIGS.values():
        monkeypatch.setitem(cfg, "topk", ((dd.MAX_BUDGET, chunk, 4, tile, None),))
    monkeypatch.setattr(dd, "SEL_TILE", tile)
    monkeypatch.setattr(dd, "MAX_MERGE", merge)
    V = 1000 if k == 1000 else 3000
    logits = topk_rows(torch.Generator().manual_seed(k), V).to(device=device(), dtype=torch.float16)
    ref = ops.tree.draft_topk_torch(logits, k)
    with ops.using(draft_topk="triton"):
        lp, tok = ops.draft_topk(logits, k)
    assert torch.equal(tok, ref[1]) and (lp - ref[0]).abs().max() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=requires_triton)])
def test_draft_topk(dtype, backend):
    """Integer logits: many ties, broken by lower token id; log-probs of log_softmax."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randint(-4, 4, (2, 3, 300), generator=gen).to(device=device(), dtype=dtype)
    logits[0, 0] = 0.0
    with ops.using(draft_topk=backend):
        lp, tok = ops.draft_topk(logits, 37)
    x = logits.float()
    expect = sorted(range(300), key=lambda v: (-x[1, 2, v].item(), v))[:37]
    assert tok[1, 2].tolist() == expect and tok[0, 0].tolist() == list(range(37))
    ref = torch.log_softmax(x, -1).gather(-1, tok)
    assert lp.dtype == torch.float32 and (lp - ref).abs().max() < 1e-5


def small_tree(B=6, L=4, K=3, budget=12, vocab=7, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, L, vocab, generator=gen).to(device())
    lp, tokens = ops.draft_topk(logits, K)
    roots = torch.randint(0, vocab, (B,), generator=gen).to(device())
    return ops.build_tree(lp, tokens, roots, budget), gen


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_accept_matches_host_walk(temperature):
    from ops.tree import sample_nodes_torch

    tree, gen = small_tree(B=40)
    logits = (torch.randn(40, 13, 7, generator=gen) * 2).to(device())
    seeds = torch.arange(40, device=device()) * 1000003
    step = torch.full((40,), 11, device=device())
    path, path_len, next_token = ops.accept(tree, logits, temperature, seeds=seeds, step=step)
    sampled = sample_nodes_torch(logits, temperature, None, seeds, step).tolist()
    for b in range(40):
        ref_path, ref_next = walk(tree.tokens[b].tolist(), tree.parents[b].tolist(), sampled[b], tree.max_depth)
        n = int(path_len[b])
        assert path[b, :n].tolist() == ref_path and (path[b, n:] == -1).all() and int(next_token[b]) == ref_next


def test_accept_reproducible_and_seeded():
    tree, gen = small_tree(B=64)
    logits = torch.randn(64, 13, 7, generator=gen).to(device())
    seeds = torch.zeros(64, dtype=torch.int64, device=device())
    a = ops.accept(tree, logits, 1.0, seeds=seeds, step=3)
    b = ops.accept(tree, logits, 1.0, seeds=seeds, step=3)
    c = ops.accept(tree, logits, 1.0, seeds=seeds, step=4)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[2], c[2])


def test_sampling_floor_top_k_top_p():
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.15, 0.05]]]))
    assert torch.allclose(sampling_floor(logits, 1.0, 1.0, 2), logits[..., 1])
    assert torch.allclose(sampling_floor(logits, 1.0, 0.7, 0), logits[..., 1])
    assert torch.allclose(sampling_floor(logits, 1.0, 0.85, 0), logits[..., 2])
    assert torch.allclose(sampling_floor(logits, 1.0, 0.99, 2), logits[..., 1])


@requires_triton
@pytest.mark.parametrize("temperature,top_p,top_k", [(0.0, 1.0, 0), (0.7, 1.0, 0), (1.0, 0.8, 0), (1.3, 0.9, 3)])
def test_accept_triton_matches_torch(temperature, top_p, top_k):
    tree, gen = small_tree(B=16, L=5, budget=20, vocab=37, seed=3)
    logits = (torch.randn(16, 21, 37, generator=gen) * 3).to(device())
    logits[0, 0, 5] = logits[0, 0, 9] = 50.0  # a tie at T = 0: the lower token wins
    seeds = torch.arange(16, device=device()) - 8
    args = (tree, logits, temperature, top_p, top_k, seeds, 7)
    ref = ops.accept(*args)
    with ops.using(accept="triton"):
        out = ops.accept(*args)
    for name, x, y in zip(("path", "path_len", "next_token"), out, ref):
        assert torch.equal(x, y), name


@requires_triton
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_accept_triton_vocabulary_splits(temperature):
    """A vocabulary of several splits per node; at T = 0 equal maxima in different splits go to the lower id."""
    tree, gen = small_tree(B=2, L=4, budget=12, vocab=7, seed=8)
    logits = (torch.randn(2, 13, 5000, generator=gen) * 3).to(device())
    logits[:, :, 4900] = logits[:, :, 7] = 40.0  # split 0 and the last split tie
    logits[1, 3, 4900] = 41.0
    seeds = torch.tensor([5, 6], device=device())
    ref = ops.accept(tree, logits, temperature, seeds=seeds, step=1)
    with ops.using(accept="triton"):
        out = ops.accept(tree, logits, temperature, seeds=seeds, step=1)
    for name, x, y in zip(("path", "path_len", "next_token"), out, ref):
        assert torch.equal(x, y), name


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=requires_triton)])
def test_accept_equal_sibling_tokens(backend):
    """Siblings sharing a token (a hand-made tree): the walk takes the lowest-index one, even when only a later
    one has children."""
    dev = device()
    i32 = dict(dtype=torch.int32, device=dev)
    tokens = torch.tensor([[0, 5, 5, 3, 3]], device=dev)
    parents = torch.tensor([[-1, 0, 0, 2, 1]], **i32)
    tree = Tree(tokens, parents, torch.tensor([[0, 1, 1, 2, 2]], **i32), torch.zeros(1, 5, 1, **i32),
                torch.tensor([[1, 4, 3, -1, -1]], **i32), torch.tensor([[-1, 2, -1, -1, -1]], **i32),
                torch.tensor([5], **i32), 2)
    logits = torch.zeros(1, 5, 9, device=dev)
    logits[0, 0, 5] = logits[0, 1, 3] = logits[0, 2, 3] = logits[0, 4, 7] = 10.0
    with ops.using(accept=backend):
        path, path_len, next_token = ops.accept(tree, logits, 0.0)
    assert path.tolist() == [[0, 1, 4]] and path_len.tolist() == [3] and next_token.tolist() == [7]


def sequential_compact(kv, starts, path, path_len, hidden):
    """The host loop: one entry at a time, forward (path[i] >= i makes that safe)."""
    kv = kv.clone()
    out = torch.zeros(path.shape[0], path.shape[1], hidden.shape[-1], dtype=hidden.dtype)
    for b in range(path.shape[0]):
        s = int(starts[b])
        for i in range(int(path_len[b])):
            kv[:, b, s + i] = kv[:, b, s + int(path[b, i])]
            out[b, i] = hidden[b, int(path[b, i])]
    return kv, out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=requires_triton)])
def test_compact(dtype, backend):
    gen = torch.Generator().manual_seed(4)
    layers, B, N1, D, F = 3, 4, 9, 576, 300
    kv = torch.randn(layers, B + 2, 40, D, generator=gen).to(dtype)
    hidden = torch.randn(B, N1, F, generator=gen).to(dtype)
    starts = torch.tensor([0, 5, 17, 30], dtype=torch.int32)
    path = torch.tensor([[0, 2, 5, -1, -1, -1], [0, -1, -1, -1, -1, -1], [0, 1, 2, 3, 4, 8], [0, 3, 4, 7, -1, -1]],
                        dtype=torch.int32)
    path_len = torch.tensor([3, 1, 6, 4], dtype=torch.int32)
    ref_kv, ref_hidden = sequential_compact(kv, starts, path, path_len, hidden)
    dev = device()
    kv_d = kv.to(dev)
    with ops.using(compact=backend):
        out = ops.compact(kv_d, starts.to(dev), path.to(dev), path_len.to(dev), hidden.to(dev))
    assert torch.equal(kv_d.cpu(), ref_kv) and torch.equal(out.cpu(), ref_hidden)


def test_tree_is_a_dataclass_of_tensors():
    tree, _ = small_tree(B=2)
    assert isinstance(tree, Tree) and tree.max_depth == 4 and tree.mask.shape == (2, 13, 1)
    assert tree.mask.dtype == tree.parents.dtype == tree.num_nodes.dtype == torch.int32


def test_bad_inputs():
    lp = torch.zeros(2, 3, 4)
    tok = torch.zeros(2, 3, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="budget"):
        ops.build_tree(lp, tok, torch.zeros(2, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match="tokens"):
        ops.build_tree(lp, tok.int(), torch.zeros(2, dtype=torch.int64), 4)
    with pytest.raises(ValueError, match="k = 9"):
        ops.draft_topk(torch.zeros(1, 2, 8), 9)


SM_CHECK = """
import json, sys
from triton_kernels.aot import compile_for
import triton
from triton_kernels import ddtree as dd
arch = sys.argv[1]
cfg = dd.CONFIGS[arch]
P, I, L = "*fp32", "*i32", "*i64"
TOPK_SIG = dict(x_ptr="*bf16", cval_ptr=I, cid_ptr=I, pmax_ptr=P, psum_ptr=P, pthr_ptr=I, count_ptr=I, lp_ptr=P,
                tok_ptr=L, V="i32", K="i32", CHUNKS="i32")
topk = {k: dd.topk_plan(163840, k, cfg) for k in sorted({min(r[0], dd.MAX_BUDGET) for r in cfg["topk"]})}
cases = [  # top-k: each config row at its largest K and K2.6's vocabulary
    *[(dd._topk_kernel, TOPK_SIG, dict(BITS=16, CHUNK=chunk, TILE=tile, MP=mp, MT=min(mp, dd.SEL_TILE),
       KP=triton.next_power_of_2(k), CP=triton.next_power_of_2(chunks), PDL=True), warps)
      for k, (chunk, chunks, mp, warps, tile, _) in topk.items()],
    (dd._tree_build_kernel, dict(lp_ptr=P, tok_ptr=L, root_ptr=L, o_tok=L, o_par=I, o_dep=I, o_fc=I, o_ns=I, o_mask=I,
     o_num=I, N="i32", K="i32", KS="i32", L="i32", W="i32"), dict(NP=512, NP1=1024, WP=32, ROWS=64, PDL=True),
     cfg["build_warps"]),
    (dd._tree_levels_kernel, dict(lp_ptr=P, tok_ptr=L, root_ptr=L, o_tok=L, o_par=I, o_dep=I, o_fc=I, o_ns=I,
     o_mask=I, o_num=I, s_int=I, s_flt=P, N="i32", K="i32", KS="i32", L="i32", W="i32"),
     dict(NP=512, NP1=1024, WP=32, ROWS=64, LOG=9, PDL=True), cfg["levels_warps"]),
    (dd._sample_kernel, dict(x_ptr="*bf16", num_ptr=I, seed_ptr=L, step_ptr=L, floor_ptr=P, pval_ptr=P, pidx_ptr=I,
     V="i32", N1="i32", CHUNK="i32", SPLIT="i32", inv_t="fp32"), dict(GREEDY=False, HAS_FLOOR=True,
     BLOCK=cfg["block_v"], UNROLL=cfg["unroll_v"], PDL=True), cfg["warps_v"]),
    (dd._walk_kernel, dict(pval_ptr=P, pidx_ptr=I, tok_ptr=L, par_ptr=I, path_ptr=I, len_ptr=I, next_ptr=L, N1="i32",
     L="i32", SPLIT="i32"), dict(NP1=1024, SP=4, PDL=True), 4),
    (dd._compact_kernel, dict(kv_ptr="*bf16", starts_ptr=I, path_ptr=I, len_ptr=I, hid_ptr="*bf16", out_ptr="*bf16",
     layers="i32", L1="i32", D="i32", F="i32", s_layer="i64", s_b="i64", s_pos="i64", h_b="i64", h_n="i64"),
     dict(LP=16, BD=1024, BF=256, PDL=True), 8),
]
report = {}
for fn, sig, const, warps in cases:
    res = compile_for(fn, sig, const, arch=arch, num_warps=warps, num_stages=1)
    name = f"{fn.fn.__name__}{const.get('CHUNK', '')}_{const.get('KP', '')}_{warps}"
    report[name] = [res.shared, res.registers, res.spill_bytes]
print(json.dumps(report))
"""


def test_sm120_kernels_fit():
    """Compile every DDTree kernel for sm_120 at its largest shapes (child process: the interpreter cannot)."""
    from triton_kernels.arch import SHARED_LIMIT

    report = compiled_in_child(SM_CHECK, "sm_120", env={"TRITON_DEFAULT_FP_FUSION": "1"})
    for name, (shared, registers, spills) in report.items():
        assert shared <= SHARED_LIMIT["sm_120"] and spills == 0, (name, shared, registers, spills)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=requires_triton)])
def test_accept_root_only_tree(backend):
    """A tree of the root alone (max_depth 0, what the engine samples the first token with): next_token is
    the target's sample at the root."""
    from ops.tree import sample_nodes_torch

    B, V = 5, 33
    none = torch.full((B, 1), -1, dtype=torch.int32, device=device())
    tree = Tree(torch.zeros(B, 1, dtype=torch.int64, device=device()), none, torch.zeros_like(none),
                torch.ones(B, 1, 1, dtype=torch.int32, device=device()), none, none.clone(),
                torch.ones(B, dtype=torch.int32, device=device()), 0)
    logits = torch.randn(B, 1, V, generator=torch.Generator().manual_seed(6)).to(device())
    seeds = torch.arange(B, device=device())
    for temperature in (0.0, 0.8):
        with ops.using(accept=backend):
            path, path_len, next_token = ops.accept(tree, logits, temperature, seeds=seeds, step=2)
        expect = sample_nodes_torch(logits, temperature, None, seeds, torch.full_like(seeds, 2))[:, 0]
        assert path.tolist() == [[0]] * B and path_len.tolist() == [1] * B and torch.equal(next_token, expect)
