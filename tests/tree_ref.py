"""Plain-Python DDTree (heapq tree build, host walk): the oracle the tree ops are tested against (the tree
benchmark times it as the host path). Scores are fp32 sums, as on the device."""

import heapq

import numpy as np
import torch


def build_tree_heapq(logprobs, tokens, root_token, budget):
    """One tree from logprobs/tokens [L][K] (nested lists or arrays). Returns (tokens, parents, depths) lists
    of the valid nodes in pop order, root first. Ties: lower parent node index first."""
    lp = np.asarray(logprobs, dtype=np.float32)
    L, K = lp.shape
    out_tok, parents, depths = [int(root_token)], [-1], [0]
    node_score = [np.float32(0.0)]
    heap = [(-float(lp[0, 0]), 0, 0, 1)]  # (-score, parent, rank, depth)
    while heap and len(out_tok) <= budget:
        neg, parent, rank, depth = heapq.heappop(heap)
        n = len(out_tok)
        out_tok.append(int(tokens[depth - 1][rank]))
        parents.append(parent)
        depths.append(depth)
        node_score.append(np.float32(-neg))
        if rank + 1 < K:
            s = np.float32(node_score[parent] + lp[depth - 1, rank + 1])
            heapq.heappush(heap, (-float(s), parent, rank + 1, depth))
        if depth < L:
            s = np.float32(node_score[n] + lp[depth, 0])
            heapq.heappush(heap, (-float(s), n, 0, depth + 1))
    return out_tok, parents, depths


def walk(tokens, parents, sampled, max_depth):
    """Host walk: from the root, follow the child whose token is the current node's sample.
    Returns (path node indices, next token)."""
    children = {}
    for i, p in enumerate(parents):
        if p >= 0:
            children.setdefault((p, tokens[i]), i)
    path = [0]
    while len(path) <= max_depth and (path[-1], sampled[path[-1]]) in children:
        path.append(children[(path[-1], sampled[path[-1]])])
    return path, sampled[path[-1]]


def tree_visibility(parents):
    """[T, T] bool: node t sees its ancestors and itself (parents[t] < t; -1 for a root or a padding node)."""
    T = len(parents)
    visible = torch.zeros(T, T, dtype=torch.bool)
    for t in range(T):
        n = t
        while n >= 0:
            visible[t, n] = True
            n = parents[n]
    return visible
