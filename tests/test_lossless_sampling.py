"""Losslessness of tree acceptance (`ops.accept`): with a fixed draft that differs from the target, the first
and second emitted tokens follow the target's distribution (chi-square over 10^5 samples)."""

import pytest
import torch

import ops
from ops.tree import Tree, inv_temperature, sampling_floor
from tests.conftest import gpu, requires_triton

V, L, BUDGET, SAMPLES = 8, 3, 6, 100_000
FIELDS = ("tokens", "parents", "depths", "mask", "first_child", "next_sibling", "num_nodes")
DEVICE = "cuda" if gpu() else "cpu"


def setup():
    gen = torch.Generator().manual_seed(0)
    target = torch.log_softmax(torch.randn(V, V, generator=gen) * 1.5, -1)  # bigram: row a = p(. | a)
    marginals = [target[0].exp()]
    for _ in range(L - 1):
        marginals.append(marginals[-1] @ target.exp())
    # the drafter: the target's per-depth marginals from root 0, perturbed
    draft_logits = (torch.stack(marginals).log() + torch.randn(L, V, generator=gen) * 0.5)[None].to(DEVICE)
    target = target.to(DEVICE)
    lp, tokens = ops.draft_topk(draft_logits, min(BUDGET, V))
    trees = ops.build_tree(lp.expand(V, L, -1).contiguous(), tokens.expand(V, L, -1).contiguous(),
                           torch.arange(V, device=DEVICE), BUDGET)  # one per root
    return trees, target


def pick(trees, roots):
    return Tree(*(getattr(trees, f)[roots] for f in FIELDS), max_depth=trees.max_depth)


def step(trees, target, roots, temperature, top_p, seeds, index):
    """One acceptance step from each root; returns (first emitted token, second emitted or -1, path_len)."""
    tree = pick(trees, roots)
    path, path_len, next_token = ops.accept(tree, target[tree.tokens], temperature, top_p=top_p, seeds=seeds,
                                            step=index)
    node_tok = tree.tokens.gather(1, path.clamp(min=0).long())  # [S, L+1]
    first = torch.where(path_len >= 2, node_tok[:, 1], next_token)
    second = torch.where(path_len >= 3, node_tok[:, 2], torch.where(path_len == 2, next_token, -1))
    return first, second


def target_probs(target, temperature, top_p):
    logits = target[None]  # [1, V, V]
    x = logits * inv_temperature(temperature)
    if top_p < 1:
        x = x.masked_fill(x < sampling_floor(logits, temperature, top_p, 0)[..., None], float("-inf"))
    return x.softmax(-1)[0].double()  # [V, V]


def chi_square_p(observed, probs):
    keep = probs > 0
    assert observed[~keep].sum() == 0
    expected = probs[keep] * observed.sum()
    stat = ((observed[keep].double() - expected) ** 2 / expected).sum()
    return torch.special.gammaincc(torch.tensor((keep.sum().item() - 1) / 2.0), stat / 2).item()


@pytest.mark.parametrize("temperature,top_p", [(0.7, 1.0), (1.0, 1.0), (1.0, 0.8)])
def test_emitted_tokens_follow_the_target(temperature, top_p):
    trees, target = setup()
    seeds = torch.arange(SAMPLES, dtype=torch.int64, device=DEVICE) * 7 + 1
    roots = torch.zeros(SAMPLES, dtype=torch.long, device=DEVICE)
    first, second = step(trees, target, roots, temperature, top_p, seeds, 0)
    # where only the bonus token came out, the second token is the next step's first, from the new root
    first2, _ = step(trees, target, first, temperature, top_p, seeds, 1)
    second = torch.where(second >= 0, second, first2)
    p = target_probs(target, temperature, top_p).cpu()
    p_first = p[0]
    p_second = p_first @ p
    assert chi_square_p(torch.bincount(first, minlength=V).cpu(), p_first) > 0.01
    assert chi_square_p(torch.bincount(second, minlength=V).cpu(), p_second) > 0.01


def test_draft_accepts_more_than_one_token():
    """The draft is good enough that the walk goes past the root often: the test above exercises the tree."""
    trees, target = setup()
    tree = pick(trees, torch.zeros(1000, dtype=torch.long, device=DEVICE))
    _, path_len, _ = ops.accept(tree, target[tree.tokens], 1.0, seeds=torch.arange(1000, device=DEVICE), step=0)
    assert (path_len >= 2).float().mean() > 0.3 and (path_len >= 3).any()


@requires_triton
def test_triton_agrees_on_the_chi_square_setup():
    trees, target = setup()
    tree = pick(trees, torch.zeros(48, dtype=torch.long, device=DEVICE))
    args = (tree, target[tree.tokens], 0.7)
    kwargs = dict(seeds=torch.arange(48, device=DEVICE) * 7 + 1, step=0)
    ref = ops.accept(*args, **kwargs)
    with ops.using(accept="triton"):
        out = ops.accept(*args, **kwargs)
    assert all(torch.equal(x, y) for x, y in zip(out, ref))
