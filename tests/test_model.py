"""The model built from ops: absorbed vs naive MLA, tree verification vs per-path runs, cache bookkeeping."""

import pytest
import torch

import ops
from model.config import preset
from model.model import Attention, KimiModel
from tests.conftest import rel_err
from tests.tree_ref import tree_visibility


def tiny_model(name="tiny", seed=0):
    return KimiModel(preset(name), dtype=torch.float32).init_random_(seed).prepare()


def naive_attention(attn, x, meta, kv):
    """The expanded MLA of the paper, causal, in fp32: per-head keys k_nope = W_UK c and scores q_nope.k_nope +
    q_pe.k_pe over the cache entries [c ; k_pe] the absorbed form writes; the head output is W_UV sum_j p_j c_j."""
    cfg, R = attn.cfg, attn.cfg.kv_lora_rank
    q_nope, q_pe, write = attn.project(ops.linear(x, attn.down_proj_weight), meta, kv, x)
    w_uk, w_uv = attn.absorption_weights()
    ops.absorb_query(q_nope, q_pe, w_uk, meta.positions, attn.inv_freq, attn.rope_factor, write)  # the entries
    q_pe = ops.apply_rope(q_pe, meta.positions, attn.inv_freq, attn.rope_factor)
    o_lat = torch.empty(meta.B, meta.T, attn.heads, R)
    causal = torch.ones(meta.T, meta.T, dtype=torch.bool).tril()
    for b, length in enumerate(meta.lens_after.tolist()):
        c, k_pe = kv[b, :length, :R].float(), kv[b, :length, R:].float()
        k_nope = torch.einsum("hdc,lc->lhd", w_uk.float(), c)
        rows = slice(b * meta.T, (b + 1) * meta.T)
        scores = (torch.einsum("thd,lhd->htl", q_nope[rows].float(), k_nope)
                  + torch.einsum("thr,lr->htl", q_pe[rows].float(), k_pe)) * cfg.softmax_scale
        visible = torch.ones(meta.T, length, dtype=torch.bool)
        visible[:, length - meta.T :] = causal
        o_lat[b] = torch.einsum("htl,lc->thc", scores.masked_fill(~visible, float("-inf")).softmax(-1), c)
    o = ops.absorb_output(o_lat.view(-1, attn.heads, R), w_uv)
    return ops.linear(o, attn.o_proj.weight)


@pytest.mark.parametrize("name", ["tiny", "tiny-grouped"])
def test_absorbed_equals_naive_mla(name, monkeypatch):
    model = tiny_model(name)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 9))
    positions = torch.arange(9).expand(2, 9)
    absorbed = model(tokens, positions, model.new_cache(2, 32)).logits
    monkeypatch.setattr(Attention, "forward", naive_attention)
    naive = model(tokens, positions, model.new_cache(2, 32)).logits
    assert rel_err(absorbed, naive) < 1e-5


def random_tree(n, generator):
    """Parents of a random tree over nodes 0..n-1 (node 0 the root, each parent earlier than its child)."""
    return [-1] + [int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, n)]


def ancestors(parents, i):
    path = [i]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def test_tree_verify_equals_each_root_to_node_path():
    model = tiny_model()
    gen = torch.Generator().manual_seed(4)
    prompt = torch.randint(0, model.cfg.vocab_size, (11,), generator=gen).tolist()
    n = 37  # crosses a 32-bit mask word
    parents = random_tree(n, gen)
    tree_tokens = torch.randint(0, model.cfg.vocab_size, (n,), generator=gen)
    depths = torch.tensor([len(ancestors(parents, i)) - 1 for i in range(n)])

    cache = model.new_cache(1, 64)
    model(torch.tensor([prompt]), torch.arange(len(prompt))[None], cache)
    cache.advance([len(prompt)])
    visible = tree_visibility(parents)[None]
    out = model(tree_tokens[None], (len(prompt) + depths)[None], cache, tree_mask=ops.pack_tree_mask(visible))

    for i in range(n):
        path = ancestors(parents, i)
        chain = prompt + tree_tokens[path].tolist()
        ref_cache = model.new_cache(1, 64)
        ref = model(torch.tensor([chain]), torch.arange(len(chain))[None], ref_cache).logits[0, -1]
        assert rel_err(out.logits[0, i], ref) < 1e-5, f"node {i}"


def test_logit_rows_and_hidden_layers():
    model = tiny_model()
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 5))
    positions = torch.arange(5).expand(2, 5)
    full = model(tokens, positions, model.new_cache(2, 8), hidden_layers=(2, 0))
    rows = torch.tensor([[4], [1]])
    some = model(tokens, positions, model.new_cache(2, 8), logit_rows=rows, hidden_layers=(0,))
    assert rel_err(some.logits[:, 0], full.logits[[0, 1], [4, 1]]) < 1e-6
    D = model.cfg.hidden_size
    assert full.hidden.shape == (2, 5, 2 * D) and rel_err(some.hidden, full.hidden[..., D:]) < 1e-6


def test_decode_with_cache_equals_full_prefill():
    model = tiny_model("tiny-grouped")
    seq = torch.randint(0, model.cfg.vocab_size, (1, 12))
    full = model(seq, torch.arange(12)[None], model.new_cache(1, 16)).logits[0]
    cache = model.new_cache(1, 16)
    model(seq[:, :6], torch.arange(6)[None], cache)
    cache.advance([6])
    for t in range(6, 12):
        step = model(seq[:, t : t + 1], torch.tensor([[t]]), cache).logits[0, 0]
        cache.advance([1])
        assert rel_err(step, full[t]) < 1e-5


def test_bad_inputs_raise_clear_errors():
    model = tiny_model()
    cache = model.new_cache(1, 8)
    with pytest.raises(ValueError, match="exceed the context of 8"):
        model(torch.zeros(1, 9, dtype=torch.long), torch.arange(9)[None], cache)
    with pytest.raises(ValueError, match="positions"):
        model(torch.zeros(1, 3, dtype=torch.long), torch.arange(4)[None], cache)
    with pytest.raises(ValueError, match="hidden_layers"):
        model(torch.zeros(1, 3, dtype=torch.long), torch.arange(3)[None], cache, hidden_layers=(7,))
    with pytest.raises(ValueError, match="batch 2 exceeds"):
        model(torch.zeros(2, 3, dtype=torch.long), torch.arange(3).expand(2, 3), cache)
    with pytest.raises(ValueError, match="tree_mask"):
        model(torch.zeros(1, 3, dtype=torch.long), torch.arange(3)[None], cache,
              tree_mask=torch.zeros(1, 3, 2, dtype=torch.int32))


def test_one_tp_rank_holds_its_shard():
    from model.parallel import Parallel

    cfg = preset("tiny")
    rank = KimiModel(cfg, Parallel(2, 1), dtype=torch.float32)
    attn = rank.layers[0].self_attn
    assert attn.heads == cfg.num_attention_heads // 2
    assert rank.lm_head.weight.shape[0] == cfg.vocab_size // 2
    assert rank.layers[1].mlp.experts.down_packed.shape[-1] == cfg.moe_intermediate_size // 2 // 8
    with pytest.raises(ValueError, match="does not split"):
        KimiModel(cfg, Parallel(3, 0), dtype=torch.float32)


def test_moe_sum_in_the_next_norm_rounds_as_separate_adds(monkeypatch):
    """A MoE layer hands its (routed, shared) pair to the next norm, which sums them in its launch: logits and
    kept hidden states equal, bit for bit, those of the layer adding its shared expert itself (bf16, where the
    order and the roundings of the adds show)."""
    import model.model as model_module

    model = KimiModel(preset("tiny"), dtype=torch.bfloat16).init_random_(3).prepare()
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(3))
    positions = torch.arange(6).expand(2, 6)
    last = model.cfg.num_hidden_layers - 1
    runs = []
    for in_norm in (True, False):
        monkeypatch.setattr(model_module, "SUM_SHARED_IN_NORM", in_norm)
        runs.append(model(tokens, positions, model.new_cache(2, 8), hidden_layers=(last, 0)))
    assert any(model_module.MoE is type(layer.mlp) for layer in model.layers[1:])
    assert torch.equal(runs[0].logits, runs[1].logits) and torch.equal(runs[0].hidden, runs[1].hidden)
