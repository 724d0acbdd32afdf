"""CUDA graphs of a DDTree step: the target's verify pass per tree-size bucket (`StepGraphs`), and the
drafter's pass + top-k + tree build per context bucket (`DraftGraphs`).

A bucket is a tree budget N (N + 1 nodes with the root); budget 0 is the root-only verify of target-only
decoding (one token, causal). A verify of N nodes pads to the smallest captured bucket >= N: padded nodes
are token 0 at the root's position (depth 0) with a self-only mask, so no real node sees them, none is a
child of anything and acceptance never walks into them; the real nodes' logits and features are those of
the unpadded tree. A verify outside every bucket runs eagerly.

Static buffers are sized for the largest bucket: one flat storage per input (tokens, positions, tree mask)
of which bucket b uses the first B*(b+1)(*words) entries as a contiguous [B, b+1(, words)] view, and flat
outputs (logits, features) into which each captured pass copies its result. The graph also bakes in the
cache's `kv` and `lens` tensors: a `StepGraphs` serves that one cache object.

Capture needs a pass without host synchronisation: the torch references of attention and moe read lengths
and expert counts back (`.tolist()`), so graphs are offered only when every op with a kernel on the verify
path runs Triton on a CUDA device (`eligibility`, `draft_eligibility`); otherwise the caller runs eagerly.
"""

import time

import torch

import ops
from model.model import ForwardOutput
from spec.drafter import DFlashDrafter

DEFAULT_BUCKETS = (0, 8, 16, 32, 64, 128)
VERIFY_KERNEL_OPS = ("attention", "absorb_query", "moe")  # the ops on the verify path that have Triton kernels
DRAFT_KERNEL_OPS = ("draft_topk", "tree_build")  # the same for the draft + tree build (their references loop)


def parse_buckets(spec):
    """'0,8,16' -> (0, 8, 16): sorted, distinct, non-negative budgets."""
    try:
        values = sorted({int(part) for part in spec.split(",") if part.strip()})
    except ValueError:
        raise ValueError(f"buckets: expected comma-separated integers, got {spec!r}") from None
    if not values or values[0] < 0:
        raise ValueError(f"buckets: need at least one budget >= 0, got {spec!r}")
    return tuple(values)


def bucket_for(n, buckets=DEFAULT_BUCKETS):
    """The smallest bucket >= budget n, or None (run eagerly) when n is past the largest."""
    fits = [b for b in buckets if b >= n]
    return min(fits) if fits else None


def mask_words(nodes):
    return (nodes + 31) // 32


def self_mask(B, nodes, device):
    """[B, nodes, words] int32: every node sees only itself (the padded nodes' rows)."""
    dense = torch.eye(nodes, dtype=torch.bool, device=device).expand(B, nodes, nodes)
    return ops.pack_tree_mask(dense)


def eligibility(model):
    """(True, '') when the verify pass of `model` can be captured; else (False, why)."""
    dev, dtype = model.device, model.dtype
    if dev.type != "cuda":
        return False, f"CUDA graphs need a CUDA device (model on {dev.type})"
    if model.par.joined:
        return False, "CUDA graphs are not captured across tensor-parallel collectives"
    torch_ops = [name for name in VERIFY_KERNEL_OPS if ops.current(name, dev, dtype) != "triton"]
    if torch_ops:
        return False, f"ops {', '.join(torch_ops)} run their torch references, which synchronise the host"
    return True, ""


def draft_eligibility(drafter):
    """(True, '') when a drafter's pass + top-k + tree build can be captured; else (False, why)."""
    if not isinstance(drafter, DFlashDrafter):
        return False, f"{type(drafter).__name__} is not a DFlashDrafter"
    if drafter.device.type != "cuda":
        return False, f"CUDA graphs need a CUDA device (drafter on {drafter.device.type})"
    if drafter.target is None or drafter.target.par.joined:
        return False, "the drafter is unbound or joined over tensor-parallel ranks"
    torch_ops = [name for name in DRAFT_KERNEL_OPS if ops.current(name, drafter.device) != "triton"]
    if torch_ops:
        return False, f"ops {', '.join(torch_ops)} run their torch references"
    return True, ""


def capture_graph(run, device, pool):
    """Warm `run` up twice on a side stream (compiles, allocates), then capture it into a CUDA graph in `pool`."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        run()
    return graph


class StaticBuffers:
    """Inputs and outputs of the captured passes, sized for `batch` sequences of `max_nodes` nodes."""

    def __init__(self, batch, max_nodes, vocab, features, logits_dtype, hidden_dtype, device):
        self.batch, self.max_nodes = batch, max_nodes
        words = mask_words(max_nodes)
        self.tokens = torch.zeros(batch * max_nodes, dtype=torch.int64, device=device)
        self.positions = torch.zeros(batch * max_nodes, dtype=torch.int64, device=device)
        self.mask = torch.zeros(batch * max_nodes * words, dtype=torch.int32, device=device)
        self.logits = torch.zeros(batch * max_nodes * vocab, dtype=logits_dtype, device=device)
        self.hidden = torch.zeros(batch * max_nodes * features, dtype=hidden_dtype, device=device) if features else None
        self.vocab, self.features = vocab, features

    def views(self, nodes):
        """Contiguous [B, nodes(, ...)] views for one bucket: tokens, positions, mask, logits, hidden."""
        B, n = self.batch, self.batch * nodes
        words = mask_words(nodes)
        hidden = self.hidden[: n * self.features].view(B, nodes, self.features) if self.features else None
        return (self.tokens[:n].view(B, nodes), self.positions[:n].view(B, nodes),
                self.mask[: n * words].view(B, nodes, words), self.logits[: n * self.vocab].view(B, nodes, self.vocab),
                hidden)


class StepGraphs:
    """Verify passes of `model` over `cache` for a batch of `batch` sequences, captured per bucket.

    hidden_layers: the layers whose outputs the verify returns (the drafter's features), fixed at capture.
    `verify(tokens, positions, tree_mask)` has the model's forward signature and result for the first B
    rows of the cache; it replays a graph when one fits and runs eagerly otherwise.
    """

    def __init__(self, model, cache, batch, buckets=DEFAULT_BUCKETS, hidden_layers=(), log=print):
        if batch > cache.batch:
            raise ValueError(f"graphs: batch {batch} exceeds the cache's {cache.batch} rows")
        self.model, self.cache, self.batch = model, cache, batch
        self.buckets, self.hidden_layers, self.log = tuple(sorted(buckets)), tuple(hidden_layers), log
        _, v_local = model.par.shard(model.cfg.vocab_size, "vocab_size")
        vocab = model.cfg.vocab_size if model.par.joined else v_local
        features = len(self.hidden_layers) * model.cfg.hidden_size
        self.bufs = StaticBuffers(batch, self.buckets[-1] + 1, vocab, features, model.dtype, model.dtype,
                                  model.device)
        self.self_masks = {b: self_mask(batch, b + 1, model.device) for b in self.buckets}  # padding templates
        self.graphs = {}
        self.pool = None
        self.key = None  # what the owner built it for (the engine reuses it while the key matches)

    def run_static(self, bucket):
        """The captured body: forward over the bucket's static inputs, results copied into the static outputs."""
        tokens, positions, mask, logits, hidden = self.bufs.views(bucket + 1)
        out = self.model(tokens, positions, self.cache, tree_mask=mask if bucket else None,
                         hidden_layers=self.hidden_layers)
        logits.copy_(out.logits)
        if hidden is not None:
            hidden.copy_(out.hidden)

    def capture(self):
        """Capture every bucket (largest first, one memory pool), after a warm-up on a side stream."""
        dev = self.model.device
        self.cache.check_room(self.buckets[-1] + 1, range(self.batch))
        for bucket in reversed(self.buckets):
            t0 = time.perf_counter()
            self._reset_inputs(bucket)
            graph = capture_graph(lambda: self.run_static(bucket), dev, self.pool)
            self.pool = graph.pool()
            self.graphs[bucket] = graph
            torch.cuda.synchronize(dev)
            self.log(f"cuda graph: verify of {bucket + 1} node(s) x batch {self.batch} captured "
                     f"in {time.perf_counter() - t0:.2f} s")
        return self

    def _reset_inputs(self, bucket):
        tokens, positions, mask, _, _ = self.bufs.views(bucket + 1)
        tokens.zero_()
        positions.zero_()
        mask.copy_(self.self_masks[bucket])

    def bucket(self, T, causal):
        """The captured bucket a verify of T tokens replays in, or None (eager: a causal block, or too big)."""
        if causal and T > 1:
            return None
        return bucket_for(T - 1, tuple(self.graphs))

    def load(self, bucket, tokens, positions, tree_mask):
        """Copy a verify's inputs into the bucket's static views, padding past T (no host sync). A causal
        verify (tree_mask None) is a single token here: its self-only row is the template's."""
        T = tokens.shape[1]
        s_tok, s_pos, s_mask, _, _ = self.bufs.views(bucket + 1)
        s_tok[:, :T].copy_(tokens)
        s_pos[:, :T].copy_(positions)
        if T < bucket + 1:
            s_tok[:, T:].zero_()
            s_pos[:, T:].copy_(positions[:, :1].expand(-1, bucket + 1 - T))
        if bucket:
            s_mask.copy_(self.self_masks[bucket])
            if tree_mask is not None:
                s_mask[:, :T].zero_()
                s_mask[:, :T, : tree_mask.shape[2]].copy_(tree_mask)

    def verify(self, tokens, positions, tree_mask=None):
        """The target's verify pass (forward with hidden_layers fixed at capture): replayed or eager."""
        B, T = tokens.shape
        bucket = self.bucket(T, tree_mask is None) if B == self.batch else None
        if bucket is None:
            return self.model(tokens, positions, self.cache, tree_mask=tree_mask, hidden_layers=self.hidden_layers)
        self.cache.check_room(bucket + 1, range(B))
        self.load(bucket, tokens, positions, tree_mask)
        self.graphs[bucket].replay()
        _, _, _, logits, hidden = self.bufs.views(bucket + 1)
        return ForwardOutput(logits[:, :T], hidden[:, :T] if hidden is not None else None)


class DraftGraphs:
    """The drafter's pass, top-k and tree build of one budget, captured per context bucket. `make_tree(logits,
    bonus)` turns the drafter's logits into the tree (default: top-k and the best-first build of `budget`);
    every tensor field of what it returns comes back.

    The drafter's attention bounds its work by a host length (the longest context + the block); a graph fixes
    it at the context bucket's end (a multiple of `granularity`, at most the cache's length), which changes
    nothing but the masked work. Graphs are captured on first use of a bucket and share one memory pool; the
    tree comes back in static buffers, valid until the next `tree` call.
    """

    def __init__(self, drafter, cache, batch, budget, granularity=1024, log=print, make_tree=None):
        self.drafter, self.cache, self.batch, self.budget = drafter, cache, batch, budget
        self.make_tree = make_tree or self.best_first
        self.granularity, self.log = granularity, log
        self.bonus = torch.zeros(batch, dtype=torch.int64, device=drafter.device)
        self.graphs, self.outputs, self.pool = {}, None, None
        self.max_depth = None  # the trees' L, known after the first pass

    def span(self):
        """The attention length of the next draft, rounded up to its bucket (host ints only)."""
        need = max(self.cache.host_lens[: self.batch]) + self.drafter.cfg.block_size
        return min(-(-need // self.granularity) * self.granularity, self.cache.max_len)

    def run_static(self, span):
        """The captured body: draft, top-k and tree build over `span` entries, the tree copied into the outputs."""
        S = self.drafter.cfg.block_size
        view = type(self.cache)(self.cache.k, self.cache.v, self.cache.lens, [span - S] * self.batch)
        tree = self.make_tree(self.drafter.draft(view, self.bonus), self.bonus)
        if self.outputs is None:
            self.outputs = {name: torch.empty_like(t) for name, t in vars(tree).items() if torch.is_tensor(t)}
            self.max_depth, self.tree_type = tree.max_depth, type(tree)
        for name, out in self.outputs.items():
            out.copy_(getattr(tree, name))

    def capture(self, span):
        dev, t0 = self.drafter.device, time.perf_counter()
        if self.outputs is None:
            self.run_static(span)  # allocates the static outputs on this stream
        graph = capture_graph(lambda: self.run_static(span), dev, self.pool)
        self.pool, self.graphs[span] = graph.pool(), graph
        self.log(f"cuda graph: draft + tree of budget {self.budget} over {span} context entries captured "
                 f"in {time.perf_counter() - t0:.2f} s")

    def tree(self, bonus):
        """draft -> draft_topk -> build_tree for the next step (bonus [B] int64), as one replay."""
        span = self.span()
        self.cache.check_room(self.drafter.cfg.block_size)
        self.bonus.copy_(bonus)
        if span not in self.graphs:
            self.capture(span)
        self.graphs[span].replay()
        return self.tree_type(**self.outputs, max_depth=self.max_depth)

    def best_first(self, logits, bonus):
        logprobs, tokens = ops.draft_topk(logits, min(self.budget, logits.shape[-1]))
        return ops.build_tree(logprobs, tokens, bonus, self.budget)
