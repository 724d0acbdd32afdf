"""DDTree ops: drafter top-k, best-first tree build, lossless acceptance, KV compaction.

Everything stays on the device: no op here reads a tensor back to the host.
Tie rules (the same in every backend and in the tests' heapq oracle, `tests/tree_ref.py`):
- top-k: larger logit first, equal logits by lower token id;
- tree build: larger cumulative log-prob first, equal ones by lower parent node index (each parent has at most
  one candidate in the frontier at a time: its next unexpanded child rank), -0.0 counted as +0.0;
- sampling: argmax (T = 0) or Gumbel-max (T > 0), equal keys by lower token id; a child matched by the sample
  is the lowest-index child with that token.
"""

from dataclasses import dataclass

import torch

from ops._backend import dispatch, register
from ops._checks import check_dims, check_dtype
from ops.attention import pack_tree_mask

MASK32 = 0xFFFFFFFF
_MIX_A, _MIX_B = 0x7FEB352D, 0x5BD1E995  # odd multipliers below 2^31: products of a 32-bit value fit in int64
_SEED_SALT, _TOKEN_SALT = 0x243F6A88, 0x85A308D3


@dataclass
class Tree:
    """A batch of draft trees, nodes in pop order; node 0 is the root (the bonus token).

    tokens [B, N+1] int64; parents [B, N+1] int32 (root -1); depths [B, N+1] int32 (root 0);
    mask [B, N+1, ceil((N+1)/32)] int32, ancestor-or-self bits (bit j%32 of word j//32 of row i);
    first_child, next_sibling [B, N+1] int32 (-1 = none; children in rank order); num_nodes [B] int32 (valid
    nodes incl. the root; later nodes are padding: token 0, parent -1, depth 0, mask self only);
    max_depth: L, the drafter's depth count (accepted paths have at most L+1 nodes).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    depths: torch.Tensor
    mask: torch.Tensor
    first_child: torch.Tensor
    next_sibling: torch.Tensor
    num_nodes: torch.Tensor
    max_depth: int


def draft_topk(logits, k):
    """Per depth, the k most likely tokens of the drafter, as log-probs.

    logits: [B, L, V] float. Returns (logprobs [B, L, k] fp32 of log_softmax(logits), tokens [B, L, k] int64),
    descending; equal logits in order of lower token id. 1 <= k <= V.
    """
    check_dims("logits", logits, 3)
    if not 1 <= k <= logits.shape[-1]:
        raise ValueError(f"draft_topk: k = {k} must be in [1, V = {logits.shape[-1]}]")
    return dispatch("draft_topk", logits.device)(logits, k)


def build_tree(logprobs, tokens, root_tokens, budget):
    """Best-first DDTree of `budget` nodes under the root: of all trees of that size, the one with the largest
    expected acceptance length if the drafter's per-depth marginals were right.

    logprobs: [B, L, K] fp32 per-depth top-K log-probs (<= 0, as log_softmax gives), descending per depth;
    tokens: [B, L, K] int64 their token ids;
    root_tokens: [B] int64 the bonus tokens. A max-heap on cumulative log-prob (fp32 sums parent + logprob);
    a pop adds a node and pushes its next sibling (rank + 1 < K) and its first child (depth < L). Ties: lower
    parent node index first. Returns a `Tree` with N = budget (fewer valid nodes only if K and L run out).
    """
    check_dims("logprobs", logprobs, 3)
    check_dims("tokens", tokens, 3)
    if tokens.shape != logprobs.shape or root_tokens.shape != logprobs.shape[:1]:
        raise ValueError(f"build_tree: logprobs {tuple(logprobs.shape)}, tokens {tuple(tokens.shape)}, "
                         f"root_tokens {tuple(root_tokens.shape)} do not fit [B, L, K], [B, L, K], [B]")
    check_dtype("logprobs", logprobs, torch.float32)
    check_dtype("tokens", tokens, torch.int64)
    check_dtype("root_tokens", root_tokens, torch.int64)
    if budget < 1:
        raise ValueError(f"build_tree: budget {budget} must be >= 1")
    return Tree(*dispatch("tree_build", logprobs.device)(logprobs, tokens, root_tokens, budget), max_depth=logprobs.shape[1])


def accept(tree, target_logits, temperature, top_p=1.0, top_k=0, seeds=None, step=0):
    """Lossless acceptance: sample the target at every node, walk from the root while the current node's sample
    is one of its children's tokens; the last node's sample is the bonus token. Every emitted token is then a
    sample of the target itself (its argmax at T = 0), whatever the drafter proposed.

    target_logits: [B, N+1, V] float, row i = the target's logits after node i. temperature 0: argmax;
    otherwise Gumbel-max over softmax(logits / T), restricted to the top_k largest (0 = all) and then to the
    smallest top_p nucleus (1.0 = all; tokens tied with the last kept logit are kept). The uniform of token v at
    node i is a hash of (seeds[b], step[b], i, v): reproducible and identical across backends.
    seeds: [B] int64 (None: zeros); step: [B] int64 or an int.
    Returns (path [B, L+1] int32 node indices root first, -1 padded; path_len [B] int32 >= 1 counting the root;
    next_token [B] int64).
    """
    B, N1 = tree.tokens.shape
    check_dims("target_logits", target_logits, 3)
    if target_logits.shape[:2] != (B, N1):
        raise ValueError(f"accept: target_logits {tuple(target_logits.shape)} do not fit the tree [{B}, {N1}]")
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise ValueError(f"accept: bad sampling temperature={temperature}, top_p={top_p}, top_k={top_k}")
    device = target_logits.device
    seeds = torch.zeros(B, dtype=torch.int64, device=device) if seeds is None else seeds
    if isinstance(step, int):
        step = torch.full((B,), step, dtype=torch.int64, device=device)
    if seeds.shape != (B,) or step.shape != (B,):
        raise ValueError(f"accept: seeds {tuple(seeds.shape)} and step {tuple(step.shape)} must be [{B}]")
    check_dtype("seeds", seeds, torch.int64)
    check_dtype("step", step, torch.int64)
    floor = None
    if temperature > 0 and (top_p < 1 or 0 < top_k < target_logits.shape[-1]):
        floor = sampling_floor(target_logits, temperature, top_p, top_k)
    return dispatch("accept", target_logits.device)(tree, target_logits, float(temperature), floor, seeds, step)


def compact(kv, starts, path, path_len, hidden):
    """Move the accepted nodes' cache entries into place and gather their hidden states, in place on kv.

    kv: [layers, Bc, L_max, D] with Bc >= B; starts: [B] int32 (where the verify pass wrote node 0);
    path: [B, L+1] int32 from `accept`; path_len: [B] int32; hidden: [B, N+1, F].
    For every layer: kv[l, b, starts[b] + i] = kv[l, b, starts[b] + path[b, i]] for i < path_len[b] (all
    sources read before any write). Returns hidden_path [B, L+1, F]: hidden[b, path[b, i]], zeros past path_len.
    """
    check_dims("kv", kv, 4)
    check_dims("path", path, 2)
    check_dims("hidden", hidden, 3)
    B = path.shape[0]
    if starts.shape != (B,) or path_len.shape != (B,) or hidden.shape[0] != B or kv.shape[1] < B:
        raise ValueError(f"compact: kv {tuple(kv.shape)}, starts {tuple(starts.shape)}, path {tuple(path.shape)}, "
                         f"path_len {tuple(path_len.shape)}, hidden {tuple(hidden.shape)} do not fit")
    check_dtype("starts", starts, torch.int32)
    check_dtype("path", path, torch.int32)
    check_dtype("path_len", path_len, torch.int32)
    return dispatch("compact", kv.device)(kv, starts, path, path_len, hidden)


# ---- shared helpers (both backends) ----

def sampling_floor(target_logits, temperature, top_p, top_k):
    """[B, N+1] fp32: the smallest scaled logit (logits * fp32(1/T)) kept by top-k then top-p."""
    x = target_logits.float() * inv_temperature(temperature)
    V = x.shape[-1]
    xs = x.sort(-1, descending=True).values
    if 0 < top_k < V:
        xs = xs.masked_fill(torch.arange(V, device=x.device) >= top_k, float("-inf"))
    if top_p >= 1:
        return xs[..., min(top_k, V) - 1] if top_k > 0 else xs[..., -1]
    p = xs.softmax(-1)
    keep = (p.cumsum(-1) - p) < top_p  # [B, N+1, V]: the prefix up to the token that reaches top_p
    count = keep.sum(-1, keepdim=True).clamp(1, top_k if top_k > 0 else V)
    return xs.gather(-1, count - 1).squeeze(-1)


def inv_temperature(temperature):
    return torch.tensor(1.0 / temperature, dtype=torch.float32).item()


def mix32(x):
    """A 32-bit integer mixer on int64 tensors holding values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * _MIX_A) & MASK32
    x = x ^ (x >> 15)
    x = (x * _MIX_B) & MASK32
    return x ^ (x >> 16)


def stream_key(seeds, step):
    """[B] int64 in [0, 2^32): the random stream of (seed, step)."""
    k = mix32((seeds & MASK32) ^ _SEED_SALT)
    k = mix32(k ^ ((seeds >> 32) & MASK32))
    k = mix32(k ^ (step & MASK32))
    return mix32(k ^ ((step >> 32) & MASK32))


def gumbel(key, node, token):
    """Gumbel noise -log(-log(u)), u = (h >> 9 + 0.5) / 2^23 from h = hash(key, node, token); broadcasts."""
    h = mix32(mix32(mix32(key ^ node) ^ token) ^ _TOKEN_SALT)
    u = ((h >> 9).float() + 0.5) * (2.0**-23)
    return -torch.log(-torch.log(u))


def ordered(x):
    """fp32 -> int64 with the same order (-0.0 as +0.0): the tree build's heap key."""
    bits = (x.float() + 0.0).view(torch.int32).long()
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


# ---- torch references ----

def draft_topk_torch(logits, k):
    x = logits.float()
    order = x.sort(dim=-1, descending=True, stable=True).indices[..., :k]  # [B, L, k]
    return torch.log_softmax(x, -1).gather(-1, order), order


def build_tree_torch(logprobs, tokens, root_tokens, budget):
    B, L, K = logprobs.shape
    N, K = budget, min(K, budget)  # a rank >= N never pops: it needs N older siblings first
    dev = logprobs.device
    i32, i64 = torch.int32, torch.int64
    out_tok = torch.zeros(B, N + 1, dtype=i64, device=dev)
    out_tok[:, 0] = root_tokens
    parents = torch.full((B, N + 1), -1, dtype=i64, device=dev)
    depths = torch.zeros(B, N + 1, dtype=i64, device=dev)
    first_child = torch.full((B, N + 1), -1, dtype=i64, device=dev)
    next_sibling = torch.full((B, N + 1), -1, dtype=i64, device=dev)
    # frontier slot p = the candidate child of node p: its score, rank, depth, previous sibling, p's score
    score = torch.full((B, N), float("-inf"), device=dev)
    score[:, 0] = logprobs[:, 0, 0]
    alive = torch.zeros(B, N, dtype=torch.bool, device=dev)
    alive[:, 0] = True
    rank = torch.zeros(B, N, dtype=i64, device=dev)
    cdepth = torch.ones(B, N, dtype=i64, device=dev)
    prev = torch.full((B, N), -1, dtype=i64, device=dev)
    pscore = torch.zeros(B, N, device=dev)
    rows = torch.arange(B, device=dev)
    tiebreak = N - torch.arange(N, device=dev)  # lower slot (parent index) wins ties
    for n in range(1, N + 1):
        key = torch.where(alive, ordered(score) * 2**32 + tiebreak, torch.iinfo(i64).min)
        sl = key.argmax(-1)  # [B]
        ok = alive[rows, sl]
        s, r, d, pv, ps = score[rows, sl], rank[rows, sl], cdepth[rows, sl], prev[rows, sl], pscore[rows, sl]
        out_tok[:, n] = torch.where(ok, tokens[rows, d - 1, r.clamp(max=K - 1)], 0)
        parents[:, n] = torch.where(ok, sl, -1)
        depths[:, n] = torch.where(ok, d, 0)
        first_child[rows, sl] = torch.where(ok & (r == 0), n, first_child[rows, sl])
        pv0 = pv.clamp(min=0)  # node 0 is nobody's sibling: writing its own value back is a no-op
        next_sibling[rows, pv0] = torch.where(ok & (r > 0), n, next_sibling[rows, pv0])
        score[rows, sl] = ps + logprobs[rows, d - 1, (r + 1).clamp(max=K - 1)]
        alive[rows, sl] = ok & (r + 1 < K)
        rank[rows, sl] = r + 1
        prev[rows, sl] = n
        if n < N:
            score[:, n] = s + logprobs[rows, d.clamp(max=L - 1), 0]
            alive[:, n] = ok & (d < L)
            rank[:, n], cdepth[:, n], prev[:, n], pscore[:, n] = 0, d + 1, -1, s
    num_nodes = (parents >= 0).sum(-1) + 1
    return (out_tok, parents.to(i32), depths.to(i32), ancestor_mask(parents, L), first_child.to(i32),
            next_sibling.to(i32), num_nodes.to(i32))


def ancestor_mask(parents, L):
    """[B, N+1, W] int32 packed ancestor-or-self bits from parents [B, N+1] (-1 = none)."""
    B, N1 = parents.shape
    dense = torch.zeros(B, N1, N1, dtype=torch.bool, device=parents.device)
    cur = torch.arange(N1, device=parents.device).expand(B, N1).clone()
    rows = torch.arange(B, device=parents.device)[:, None].expand(B, N1)
    cols = torch.arange(N1, device=parents.device).expand(B, N1)
    for _ in range(L + 1):
        ok = cur >= 0
        dense[rows, cols, cur.clamp(min=0)] |= ok
        cur = torch.where(ok, parents.long().gather(1, cur.clamp(min=0)), -1)
    return pack_tree_mask(dense)


def sample_nodes_torch(target_logits, temperature, floor, seeds, step):
    """[B, N+1] int64: the target's sample at every node (argmax at T = 0, Gumbel-max otherwise)."""
    x = target_logits.float()
    if temperature == 0:
        return x.argmax(-1)
    B, N1, V = x.shape
    x = x * inv_temperature(temperature)
    node = torch.arange(N1, device=x.device)[None, :, None]
    token = torch.arange(V, device=x.device)[None, None, :]
    keys = x + gumbel(stream_key(seeds, step)[:, None, None], node, token)
    if floor is not None:
        keys = keys.masked_fill(x < floor[..., None], float("-inf"))
    return keys.argmax(-1)


def accept_torch(tree, target_logits, temperature, floor, seeds, step):
    sampled = sample_nodes_torch(target_logits, temperature, floor, seeds, step)  # [B, N+1]
    B, N1 = tree.tokens.shape
    L = tree.max_depth
    dev = sampled.device
    rows = torch.arange(B, device=dev)
    idx = torch.arange(N1, device=dev)
    cur = torch.zeros(B, dtype=torch.int64, device=dev)
    path = torch.full((B, L + 1), -1, dtype=torch.int32, device=dev)
    path[:, 0] = 0
    walking = torch.ones(B, dtype=torch.bool, device=dev)
    for d in range(1, L + 1):
        t = sampled[rows, cur]
        match = (tree.parents.long() == cur[:, None]) & (tree.tokens == t[:, None])
        child = torch.where(match, idx, N1).min(-1).values
        walking = walking & (child < N1)
        path[:, d] = torch.where(walking, child, -1).to(torch.int32)
        cur = torch.where(walking, child, cur)
    path_len = (path >= 0).sum(-1).to(torch.int32)
    return path, path_len, sampled[rows, cur]


def compact_torch(kv, starts, path, path_len, hidden):
    B, L1 = path.shape
    i = torch.arange(L1, device=path.device)
    valid = i < path_len[:, None]  # [B, L+1]
    # invalid rows copy entry starts[b] onto itself, the same value the root row writes there
    src = starts.long()[:, None] + torch.where(valid, path.long(), 0)
    dst = starts.long()[:, None] + torch.where(valid, i, 0)
    rows = torch.arange(B, device=path.device)[:, None].expand(B, L1)
    kv[:, rows, dst] = kv[:, rows, src]
    gathered = hidden.gather(1, path.long().clamp(min=0)[..., None].expand(B, L1, hidden.shape[-1]))
    return torch.where(valid[..., None], gathered, torch.zeros((), dtype=hidden.dtype, device=hidden.device))


register("draft_topk", draft_topk_torch, "triton_kernels.ddtree:draft_topk")
register("tree_build", build_tree_torch, "triton_kernels.ddtree:build_tree")
register("accept", accept_torch, "triton_kernels.ddtree:accept")
register("compact", compact_torch, "triton_kernels.ddtree:compact")
