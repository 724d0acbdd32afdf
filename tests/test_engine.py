"""The DDTree engine: greedy output equals target-only greedy token for token (random and oracle drafters,
budgets 1..64, batches of different prompt lengths, both backends), stops, reproducible sampling, and the
target-only path against HF transformers' generate."""

import inspect

import pytest
import torch

import ops
from model.checkpoint import load_model
from model.generate import greedy_generate
from spec.default_model import load_default, write_default
from spec.drafter_checkpoint import load_drafter
from spec.engine import Engine, SamplingParams
from tests.conftest import TRITON_DEVICE, requires_triton
from tests.test_generate import hf_greedy
from tests.test_model_vs_hf import hf_checkpoint, one_thread  # noqa: F401 (autouse fixture)

PROMPTS = [[257, 84, 104, 101, 32, 116, 114, 101, 101], [7], list(range(40, 63))]
NEW = 200
BUDGETS = (1, 4, 16, 64)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """The default-shaped target and drafter checkpoints, written to disk."""
    return write_default(tmp_path_factory.mktemp("pair"), seed=7)


def load_pair(paths, dtype, device="cpu"):
    target = load_model(paths[0], dtype=dtype, device=device, progress=False)
    return target, load_drafter(paths[1], target, dtype=dtype, device=device)


@pytest.fixture(scope="module")
def pair(paths):
    return load_pair(paths, torch.float32)


@pytest.fixture(scope="module")
def reference(pair):
    return greedy_generate(pair[0], PROMPTS, NEW)


class OracleDrafter:
    """Drafts the known greedy continuation: per depth its true token at rank 0 (60%), 1 or 2, or missing
    (10%), seeded; so trees are accepted deep, through later siblings, and cut short (rows whose sequence is
    None get noise). Context bookkeeping is the real drafter's."""

    def __init__(self, real, sequences, seed=0, exact=False, on_divergence="raise"):
        self.real, self.sequences, self.gen = real, sequences, torch.Generator().manual_seed(seed)
        self.exact = exact  # always rank 0: every step accepts the whole block
        self.on_divergence = on_divergence  # "noise": a row that left its sequence is drafted noise from then on
        self.cfg, self.target_layer_ids = real.cfg, real.target_layer_ids

    def new_cache(self, batch, max_len):
        return self.real.new_cache(batch, max_len)

    def append_context(self, *args, **kwargs):
        self.real.append_context(*args, **kwargs)

    def draft(self, cache, bonus):
        B, L, V = bonus.shape[0], self.cfg.draft_len, self.cfg.vocab_size
        logits = torch.randn(B, L, V, generator=self.gen)
        for b, pos in enumerate(cache.lens[:B].tolist()):
            if self.sequences[b] is None or pos >= len(self.sequences[b]):  # noise, or a finished sequence
                continue
            if self.sequences[b][pos] != bonus[b].item() and self.on_divergence == "noise":
                self.sequences[b] = None  # the caller checks the divergence itself
                continue
            assert self.sequences[b][pos] == bonus[b].item()  # the bonus sits at the committed length
            for j in range(L):
                if pos + 1 + j >= len(self.sequences[b]):
                    break
                true, u = self.sequences[b][pos + 1 + j], torch.rand((), generator=self.gen).item()
                rank = 0 if u < 0.6 else 1 if u < 0.75 else 2 if u < 0.9 else None
                decoys = [t for t in torch.randperm(V, generator=self.gen)[:3].tolist() if t != true][:2]
                for i, t in enumerate(decoys):
                    logits[b, j, t] = 10.0 - i
                if self.exact:
                    logits[b, j, true] = 30.0
                elif rank is not None:
                    logits[b, j, true] = 10.5 - rank
        return logits.to(bonus.device)


def check_accounting(result):
    for out, accepts in zip(result.output_ids, result.accept_lengths):
        assert sum(accepts) + 1 >= len(out) > sum(accepts) - max(accepts)  # prefill gives the first token


@pytest.mark.parametrize("budget", BUDGETS)
def test_greedy_ddtree_is_lossless(pair, reference, budget):
    result = Engine(*pair, budget).generate(PROMPTS, NEW)
    assert result.output_ids == reference
    assert result.finish_reasons == ["length"] * 3
    check_accounting(result)


@pytest.mark.parametrize("budget", [4, 32])
def test_greedy_ddtree_is_lossless_with_the_trained_default_drafter(budget):
    """The shipped drafter was trained on the default target's text: a real DFlash network accepting deep."""
    target, drafter, _ = load_default()
    reference = greedy_generate(target, PROMPTS, NEW)
    result = Engine(target, drafter, budget).generate(PROMPTS, NEW)
    assert result.output_ids == reference
    check_accounting(result)
    assert result.mean_accept_length > 1.5


@pytest.mark.parametrize("budget", BUDGETS)
def test_greedy_ddtree_is_lossless_with_deep_acceptance(pair, reference, budget):
    sequences = [p + r for p, r in zip(PROMPTS, reference)]
    result = Engine(pair[0], OracleDrafter(pair[1], sequences, seed=budget), budget).generate(PROMPTS, NEW)
    assert result.output_ids == reference
    check_accounting(result)
    assert result.mean_accept_length > {1: 1.4, 4: 1.9, 16: 2.6, 64: 3.5}[budget]
    assert max(max(a) for a in result.accept_lengths) >= {1: 2, 4: 3, 16: 4, 64: 5}[budget]


def test_finished_sequence_rides_along_as_padding(pair, reference):
    """Row 0 drafts perfectly and finishes early, having accepted 6 tokens past its last one; row 1 drafts
    noise and runs on for many more steps while row 0's cache rows must keep room for the trees verified."""
    prompts = [PROMPTS[0], PROMPTS[0][:5] + [99, 98, 97, 96]]
    new = 1 + 4 * 8 + 2  # the prefill's token, 4 full blocks of 8, then 2 of the 5th block's 8
    truth = greedy_generate(pair[0], prompts, new + 8)
    oracle = OracleDrafter(pair[1], [prompts[0] + truth[0], None], exact=True)
    result = Engine(pair[0], oracle, 64).generate(prompts, new)
    assert result.output_ids == [t[:new] for t in truth]
    assert result.accept_lengths[0] == [8] * 5 and len(result.accept_lengths[1]) > 10


@pytest.mark.parametrize("spec", [True, False])
def test_one_host_read_per_step(pair, monkeypatch, spec):
    """The engine and drafter read the device once per step (and once after prefill); op references may
    read more (the torch MLA reference loops over lengths), kernels do not."""
    reads = []
    for name in ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
        def counting(self, *args, _original=getattr(torch.Tensor, name), _name=name, **kwargs):
            if inspect.currentframe().f_back.f_code.co_filename.endswith(("spec/engine.py", "spec/drafter.py")):
                reads.append(_name)
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, counting)
    result = Engine(*pair, 16).generate(PROMPTS, 20, spec=spec)
    assert reads == ["tolist"] * (result.steps + 1)


def test_target_only_equals_greedy_generate(pair, reference):
    result = Engine(pair[0]).generate(PROMPTS, NEW, spec=False)
    assert result.output_ids == reference
    assert all(a == [1] * (NEW - 1) for a in result.accept_lengths)


def test_stop_token_and_context_end(pair, reference):
    stop = reference[0][30]
    result = Engine(*pair, 8).generate(PROMPTS, 60, stop_ids=[stop])
    for out, ref, reason in zip(result.output_ids, reference, result.finish_reasons):
        want = ref[: ref.index(stop) + 1] if stop in ref[:60] else ref[:60]
        assert out == want and reason == ("stop" if stop in ref[:60] else "length")

    class ShortContext(Engine):
        context_len = 30

    result = ShortContext(*pair, 8).generate(PROMPTS, 60)
    assert result.output_ids == [ref[: 30 - len(p)] for p, ref in zip(PROMPTS, reference)]
    assert result.finish_reasons == ["context"] * 3
    with pytest.raises(ValueError, match="prompt 0 has 31 tokens; the context holds 30"):
        ShortContext(*pair).generate([[5] * 31], 4)


@pytest.mark.parametrize("spec", [True, False])
def test_sampling_is_reproducible(pair, reference, spec):
    engine = Engine(*pair, 16)

    def run(seed):
        return engine.generate(PROMPTS[:2], 40, SamplingParams(temperature=0.9, top_p=0.95, seed=seed),
                               spec=spec).output_ids

    first = run(11)
    assert run(11) == first
    assert run(12) != first
    assert first != [r[:40] for r in reference[:2]]


@pytest.mark.parametrize("budget", [1, 16])
def test_bad_budget_is_refused(pair, budget):
    Engine(*pair, budget)
    with pytest.raises(ValueError, match="tree budget"):
        Engine(*pair, budget * 1000)


def test_target_only_equals_hf_generate(tmp_path):
    cfg, hf = hf_checkpoint("tiny", tmp_path / "ckpt", seed=9)
    target = load_model(tmp_path / "ckpt", dtype=torch.float32, progress=False)
    prompts = [[5, 9, 100, 7], [300, 2, 44, 45, 46, 47, 48]]
    got = Engine(target).generate(prompts, 16, spec=False).output_ids
    assert got == [hf_greedy(hf, p, 16) for p in prompts]


ON_GPU = TRITON_DEVICE == "cuda"


@requires_triton
@pytest.mark.parametrize("budget", BUDGETS if ON_GPU else (16,))
def test_greedy_ddtree_is_lossless_on_triton(paths, budget):
    """Every op with a Triton kernel on it: DDTree output equals the target-only greedy output of the same
    backend. On a GPU: 64 new tokens, every budget, all prompts; under the interpreter: a short run, since the
    interpreted top-k takes ~10 s a call. fp16 both: the verify pass and single-token decoding round differently,
    so a near-tie in bf16's 8-bit mantissa could flip a greedy choice without any bug."""
    kernels = [n for n in ops.op_names() if ops.has_triton(n)]
    prompts, new = (PROMPTS, 64) if ON_GPU else (PROMPTS[:2], 4)
    with ops.using(**{n: "triton" for n in kernels}):
        target, drafter = load_pair(paths, torch.float16, TRITON_DEVICE)
        reference = Engine(target).generate(prompts, new, spec=False).output_ids
        sequences = [p + r for p, r in zip(prompts, reference)]
        oracle = OracleDrafter(drafter, sequences, seed=1, on_divergence="noise")
        result = Engine(target, oracle, budget).generate(prompts, new)
    assert_equal_up_to_near_ties(paths, prompts, result.output_ids, reference)
    assert result.mean_accept_length > 1


def assert_equal_up_to_near_ties(paths, prompts, got, want, tie=0.02):
    """Outputs equal, or each row's first difference is a near-tie of the target: under the fp32 torch reference
    the two tokens' logits at that position differ by less than `tie` of the logits' range (a verify pass and
    a single-token step round differently in fp16, which can flip such a choice without any bug)."""
    if got == want:
        return
    target, _ = load_pair(paths, torch.float32, TRITON_DEVICE)
    for b, (g, w) in enumerate(zip(got, want)):
        i = next((i for i, (x, y) in enumerate(zip(g, w)) if x != y), None)
        if i is None:
            assert len(g) == len(w), f"row {b}: {len(g)} tokens, the reference {len(w)}"
            continue
        logits = reference_next_logits(target, prompts[b] + w[:i], TRITON_DEVICE)
        gap = (logits[w[i]] - logits[g[i]]).abs().item()
        span = (logits.max() - logits.min()).item()
        assert gap < tie * span, f"row {b} token {i}: {g[i]} vs the reference {w[i]}, fp32 logit gap {gap:.4g} " \
                                 f"of a {span:.4g} range: not a near-tie"


def reference_next_logits(target, tokens, device):
    """[V] logits after `tokens` (one prefill, every op on its torch reference)."""
    seq = torch.tensor([tokens], device=device)
    with ops.using(**{n: "torch" for n in ops.op_names()}):
        return target(seq, torch.arange(seq.shape[1], device=device)[None],
                      target.new_cache(1, seq.shape[1])).logits[0, -1]


def test_near_tie_check_rejects_a_real_difference(paths):
    """The GPU lossless test's tolerance for fp16 near-ties does not excuse a token the target did not favour."""
    target, _ = load_pair(paths, torch.float32)
    want = greedy_generate(target, PROMPTS[:1], 3)
    assert_equal_up_to_near_ties(paths, PROMPTS[:1], want, want)
    logits = reference_next_logits(target, PROMPTS[0], "cpu")
    worst = [[logits.argmin().item()] + want[0][1:]]
    with pytest.raises(AssertionError, match="not a near-tie"):
        assert_equal_up_to_near_ties(paths, PROMPTS[:1], worst, want)
