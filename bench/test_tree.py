"""DDTree step sweep at batch 1, K2.6 shapes (bf16 logits, V = 163840; 61 layers of 576-wide cache entries; the
drafter's 6 x 7168 features), trees of 8-512 nodes, drafter blocks of 8 and 16 (block - 1 depths): each Triton op
alone (draft top-K, tree build, accept greedy and at T = 1, compaction) and the whole step (those four), each
captured in a CUDA graph, and the step eager.

Times: `triton.testing.do_bench`'s method (the L2 flushed before every call; 5 ms warm-up, 25 ms of calls),
median. The target logits favour each node's first child, so accepted paths are long. Each op's outputs are
checked equal to its torch reference's (the step is made of them). Bytes: the logits the op reads (top-K: the
drafter's; accept: the target's).
"""

import pytest
import torch

import ops
from bench.common import bench_flushed, capture, record

V = 163840
LAYERS = 61
ENTRY = 576
FEATURES = 6 * 7168
L_MAX = 4096
START = 1000  # where the verify pass wrote node 0
BUDGETS = (8, 16, 32, 64, 128, 256, 512)
BLOCKS = (8, 16)
PIECES = ("topk", "build", "accept_greedy", "accept_T1", "compact", "step_eager", "step_greedy", "step_T1")
TRITON = dict(draft_topk="triton", tree_build="triton", accept="triton", compact="triton")
CASES = [(budget, block, piece) for block in BLOCKS for budget in BUDGETS for piece in PIECES]


class Case:
    """One step's inputs and a tree built from them (Triton ops)."""

    def __init__(self, budget, block, seed=0):
        self.budget, self.K = budget, min(budget, V)
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.draft_logits = (torch.randn(1, block - 1, V, generator=g, device="cuda") * 3).bfloat16()
        self.root = torch.tensor([7], device="cuda")
        self.kv = torch.randn(LAYERS, 1, L_MAX, ENTRY, generator=g, device="cuda").bfloat16()
        self.hidden = torch.randn(1, budget + 1, FEATURES, generator=g, device="cuda").bfloat16()
        self.starts = torch.tensor([START], dtype=torch.int32, device="cuda")
        self.seeds = torch.tensor([1234], device="cuda")
        self.step0 = torch.zeros(1, dtype=torch.int64, device="cuda")  # a tensor, as in the engine's graphs
        with ops.using(**TRITON):
            self.lp, self.tok = ops.draft_topk(self.draft_logits, self.K)
            self.tree = ops.build_tree(self.lp, self.tok, self.root, budget)
        logits = torch.randn(1, budget + 1, V, generator=g, device="cuda") * 3
        fc = self.tree.first_child[0].long()
        rows = torch.nonzero(fc >= 0).flatten()
        logits[0, rows, self.tree.tokens[0, fc[rows]]] = 30.0
        self.target_logits = logits.bfloat16()
        with ops.using(**TRITON):
            self.path, self.path_len, _ = self.accept(0.0)

    def accept(self, temperature):
        return ops.accept(self.tree, self.target_logits, temperature, seeds=self.seeds, step=self.step0)

    def compact(self, kv=None):
        return ops.compact(self.kv if kv is None else kv, self.starts, self.path, self.path_len, self.hidden)

    def step(self, temperature):
        lp, tok = ops.draft_topk(self.draft_logits, self.K)
        tree = ops.build_tree(lp, tok, self.root, self.budget)
        path, path_len, next_token = ops.accept(tree, self.target_logits, temperature, seeds=self.seeds,
                                                step=self.step0)
        return ops.compact(self.kv, self.starts, path, path_len, self.hidden), path_len, next_token

    def piece(self, name):
        """(the op of `name` as a thunk, its outputs' check against the torch reference or None, bytes it reads)."""
        logits_bytes = self.target_logits.numel() * 2
        if name == "topk":
            return (lambda: ops.draft_topk(self.draft_logits, self.K), "draft_topk",
                    self.draft_logits.numel() * 2)
        if name == "build":
            return lambda: vars(ops.build_tree(self.lp, self.tok, self.root, self.budget)), "tree_build", None
        if name.startswith("accept"):
            return lambda: self.accept(0.0 if name == "accept_greedy" else 1.0), "accept", logits_bytes
        if name == "compact":
            return lambda: (self.compact(), self.kv), "compact", None
        return lambda: self.step(0.0 if name != "step_T1" else 1.0), None, None


def equal(a, b):
    if isinstance(a, dict):
        return all(equal(a[k], b[k]) for k in a)
    if isinstance(a, (tuple, list)):
        return all(equal(x, y) for x, y in zip(a, b))
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def check(case, fn, op):
    """fn's outputs under Triton equal the torch reference's (top-K's log-probs within 1e-5, as the tests hold
    them; compaction each on its own copy of the cache)."""
    kv = case.kv
    outputs = []
    for backend in ("triton", "torch"):
        case.kv = kv.clone()
        with ops.using(**{op: backend}):
            outputs.append(fn())
    case.kv = kv
    got, ref = outputs
    if op == "draft_topk":
        return torch.equal(got[1], ref[1]) and (got[0] - ref[0]).abs().max().item() < 1e-5
    return equal(got, ref)


@pytest.fixture(scope="module")
def cases():
    """cases(budget, block): the Case, the latest one kept."""
    latest = {}

    def get(budget, block):
        if (budget, block) not in latest:
            latest.clear()
            torch.cuda.empty_cache()
            latest[budget, block] = Case(budget, block)
        return latest[budget, block]

    yield get
    latest.clear()


@pytest.mark.parametrize("budget,block,piece", CASES, ids=[f"budget{b}-block{k}-{p}" for b, k, p in CASES])
def test_tree(benchmark, ceilings, cases, budget, block, piece):
    case = cases(budget, block)
    fn, op, nbytes = case.piece(piece)
    with ops.using(**TRITON):
        fn()
        if benchmark.disabled:
            return
        exact = check(case, fn, op) if op else True
        if piece == "step_eager":
            us = bench_flushed(benchmark, fn, warmup_ms=5, rep_ms=25)
        else:
            us = bench_flushed(benchmark, capture([fn]).replay, warmup_ms=5, rep_ms=25)
    record(benchmark, ceilings, us, f"tree budget={budget} block={block} {piece}", nbytes=nbytes,
           path_len=int(case.path_len[0]), exact=exact)
    assert exact
