"""W4A16 MoE sweep: `ops.moe` (Triton) at one K2.6 TP8 rank (E 384, hidden 7168, intermediate 256) and one EP8
rank (E 48, intermediate 2048), top-8 routing, M = 1..512 tokens; beside it a bf16 grouped GEMM on bf16 weights.

Weights cold in L2: 16 calls a CUDA graph, each with its own routing, rotating over enough prepared layers to read
>= 4x the L2 between reuses. Each call follows a small unrelated kernel (an add on 4 KB), as the model's MoE follows
the router rather than another MoE call; that kernel's own time (timed alone) is subtracted. Bytes: the touched
experts' INT4 weights and bf16 group-32 scales (bf16 baseline: its bf16 weights). Routing: uniform top-8 over all
experts, or "step": over a random pool per call, sized so that M tokens touch as many experts as the verify step's
tokens do (STEP_EXPERTS). Each Triton case is checked against the torch reference on its first call.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import ops
from bench.common import bench_graph, graph_us, record, rel_err

SHAPES = {"tp8": dict(E=384, D=7168, I=256), "ep8": dict(E=48, D=7168, I=2048)}
MS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TOP_K = 8
CALLS = 16  # calls a graph, each with its own routing and layer
# Distinct experts a TP8 MoE layer sees in the verify step, by its tokens (bench_step.py, H200)
STEP_EXPERTS = {1: 8, 9: 43, 33: 82, 65: 99, 129: 111}
CASES = [(shape, M, "uniform") for shape in SHAPES for M in MS] + [("tp8", M, "step") for M in (9, 33, 65, 129)]


def expert_bytes(D, I):
    """INT4 weights plus bf16 group-32 scales of one expert's gate, up and down projections."""
    return 3 * D * I // 2 + 3 * D * I // 32 * 2


def layers_needed(D, I):
    """Layers to rotate over so that top-8 calls read >= 4x the L2 between reuses (2 to 8)."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return max(2, min(8, math.ceil(4 * l2 / (TOP_K * expert_bytes(D, I)))))


def random_checkpoint_layer(E, D, I, gen):
    """Random experts in the checkpoint's form (uniform INT4 words, scales in [0.001, 0.011))."""
    def words(n, k):
        w = torch.randint(-2**31, 2**31, (E, n, k // 8), generator=gen, device="cuda", dtype=torch.int32)
        s = (torch.rand(E, n, k // 32, generator=gen, device="cuda") * 0.01 + 0.001).to(torch.bfloat16)
        return w, s

    return ops.PackedExperts(*words(2 * I, D), *words(D, I))


def prepare(layer):
    return ops.prepare_moe(layer.gate_up_packed, layer.gate_up_scale, layer.down_packed, layer.down_scale,
                           activation_dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def layers():
    """layers(shape, n): (a checkpoint-form layer, [n layers prepared for Triton, the first from that one])."""
    built = {}

    def get(shape, n):
        E, D, I = SHAPES[shape].values()
        if shape not in built:
            gen = torch.Generator("cuda").manual_seed(0)
            first = random_checkpoint_layer(E, D, I, gen)
            built[shape] = (first, [prepare(first)], gen)
        first, prepared, gen = built[shape]
        while len(prepared) < n:
            prepared.append(prepare(random_checkpoint_layer(E, D, I, gen)))
        return first, prepared

    yield get
    built.clear()
    torch.cuda.empty_cache()


def step_pool(M, E):
    """Pool size P such that M tokens, each routed to top-8 of a random pool of P, touch as many distinct experts
    as the verify step's do (STEP_EXPERTS, interpolated in log M, clamped at its ends)."""
    ms = sorted(STEP_EXPERTS)
    m = min(max(M, ms[0]), ms[-1])
    hi = next(x for x in ms if x >= m)
    lo = max(x for x in ms if x <= m)
    t = 0.0 if hi == lo else math.log(m / lo) / math.log(hi / lo)
    target = STEP_EXPERTS[lo] + t * (STEP_EXPERTS[hi] - STEP_EXPERTS[lo])
    return min(range(TOP_K, E + 1), key=lambda p: abs(p * (1 - (1 - TOP_K / p) ** M) - target))


def routings(M, E, D, n, routing, gen):
    """n calls (x [M, D] bf16, top-8 ids, weights): top-8 of uniform random scores over E experts, or over a random
    pool of step_pool(M, E) of them (routing "step")."""
    out = []
    for _ in range(n):
        pool = E if routing == "uniform" else step_pool(M, E)
        chosen = torch.randperm(E, generator=gen, device="cuda")[:pool]
        ids = chosen[torch.rand(M, pool, generator=gen, device="cuda").topk(TOP_K, dim=-1).indices].int()
        weights = torch.rand(M, TOP_K, generator=gen, device="cuda")
        out.append((torch.randn(M, D, generator=gen, device="cuda").bfloat16(), ids, weights))
    return out


def after_gap(benchmark, calls):
    """(us per call of `calls` in one graph, each after an add on 4 KB; that add's own us, subtracted)."""
    gap = torch.zeros(1024, device="cuda")
    alone = graph_us([lambda: gap.add_(1.0)] * len(calls))
    us = bench_graph(benchmark, [lambda fn=fn: (gap.add_(1.0), fn()) for fn in calls])
    return max(us - alone, 1e-3), alone


@pytest.mark.parametrize("shape,M,routing", CASES, ids=[f"{s}-M{M}-{r}" for s, M, r in CASES])
def test_moe(benchmark, ceilings, layers, shape, M, routing):
    E, D, I = SHAPES[shape].values()
    calls = routings(M, E, D, CALLS, routing, torch.Generator("cuda").manual_seed(M))
    with ops.using(moe="triton"):
        checkpoint, prepared = layers(shape, 1 if benchmark.disabled else layers_needed(D, I))
        out = ops.moe(*calls[0], prepared[0])
        if benchmark.disabled:
            return
        with ops.using(moe="torch"):
            err = rel_err(out, ops.moe(*calls[0], checkpoint))
        us, gap_us = after_gap(benchmark, [lambda c=c, j=j: ops.moe(*c, prepared[j % len(prepared)])
                                           for j, c in enumerate(calls)])
    touched = sum(ids.unique().numel() for _, ids, _ in calls) / len(calls)
    record(benchmark, ceilings, us, f"moe {shape} M={M} {routing}", nbytes=touched * expert_bytes(D, I),
           experts=touched, layers=len(prepared), gap_us=gap_us, rel_err=err)
    assert err < 1e-2


def bf16_grouped(x, ids, weights, w_gate_up, w_down):
    """Tokens sorted by expert, torch._grouped_mm for gate/up and down, a weighted index_add."""
    flat = ids.flatten().long()
    order = flat.argsort()
    counts = torch.zeros(w_gate_up.shape[0], dtype=torch.int32, device=x.device)
    offs = counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32)).cumsum(0, dtype=torch.int32)
    rows = order // TOP_K
    g, u = torch._grouped_mm(x[rows], w_gate_up, offs=offs).chunk(2, dim=-1)  # [P, I] each
    y = torch._grouped_mm((F.silu(g) * u).contiguous(), w_down, offs=offs)  # [P, D]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    return out.index_add_(0, rows, y.float() * weights.flatten()[order, None]).to(x.dtype)


@pytest.fixture(scope="module")
def bf16_weights():
    """bf16_weights(shape): one layer's bf16 experts as torch._grouped_mm takes them ([E, D, 2I], [E, I, D])."""
    built = {}

    def get(shape):
        if shape not in built:
            built.clear()
            E, D, I = SHAPES[shape].values()
            gen = torch.Generator("cuda").manual_seed(1)
            gate_up = torch.randn(E, 2 * I, D, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02
            down = torch.randn(E, D, I, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.02
            built[shape] = (gate_up.transpose(1, 2), down.transpose(1, 2))
        return built[shape]

    yield get
    built.clear()
    torch.cuda.empty_cache()


UNIFORM = [case[:2] for case in CASES if case[2] == "uniform"]


@pytest.mark.parametrize("shape,M", UNIFORM, ids=[f"{s}-M{M}-uniform" for s, M in UNIFORM])
def test_moe_bf16_grouped(benchmark, ceilings, bf16_weights, shape, M):
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm is missing")
    E, D, I = SHAPES[shape].values()
    calls = routings(M, E, D, CALLS, "uniform", torch.Generator("cuda").manual_seed(M))
    weights = bf16_weights(shape)
    if benchmark.disabled:
        bf16_grouped(*calls[0], *weights)
        return
    us, gap_us = after_gap(benchmark, [lambda c=c: bf16_grouped(*c, *weights) for c in calls])
    touched = sum(ids.unique().numel() for _, ids, _ in calls) / len(calls)
    record(benchmark, ceilings, us, f"moe_bf16_grouped {shape} M={M} uniform", nbytes=touched * 3 * D * I * 2,
           experts=touched, gap_us=gap_us)
