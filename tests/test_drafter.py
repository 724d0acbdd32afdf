"""The DFlash drafter against a from-scratch reference of z-lab's forward, its context cache, and its checkpoints."""

import json

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

import ops
from model.config import preset
from model.model import KimiModel
from spec.drafter import DFlashDrafter, DrafterConfig, check_drafter_fits, default_target_layer_ids
from spec.drafter_checkpoint import checkpoint_tensors, load_drafter, write_drafter_checkpoint
from tests.conftest import gloo_rank, gpu, rel_err

TARGET = preset("tiny")


def drafter_config(**over):
    base = dict(hidden_size=TARGET.hidden_size, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=32, intermediate_size=96, vocab_size=TARGET.vocab_size, block_size=5,
                mask_token_id=TARGET.vocab_size - 2, target_layer_ids=(0, 2), rope_theta=10000.0)
    return DrafterConfig(**{**base, **over})


@pytest.fixture(scope="module")
def target():
    return KimiModel(TARGET, dtype=torch.float32).init_random_(3).prepare()


def reference_draft(d, target, features, bonus):
    """z-lab's drafter for one sequence, written out in fp64: context at positions 0..C-1, block after it."""
    cfg, w = d.cfg, {k: v.double() for k, v in checkpoint_tensors(d).items()}
    C, S, H, KVH, hd = features.shape[0], cfg.block_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

    def norm(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * weight

    def rope(x, pos):  # x [N, heads, hd], rotate-half convention
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        ang = torch.cat([pos[:, None] * inv, pos[:, None] * inv], -1)[:, None]
        rot = torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], -1)
        return x * ang.cos() + rot * ang.sin()

    D, last = cfg.hidden_size, TARGET.num_hidden_layers - 1
    hf_states = [features[:, j * D : (j + 1) * D].double() for j in range(len(cfg.target_layer_ids))]
    for j, layer in enumerate(cfg.target_layer_ids):  # HF's last hidden state is after the final norm
        if layer == last:
            x = hf_states[j]
            hf_states[j] = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + TARGET.rms_norm_eps) \
                * target.norm.weight.double()
    ctx = norm(torch.cat(hf_states, -1) @ w["fc.weight"].T, w["hidden_norm.weight"])
    block = torch.tensor([bonus] + [cfg.mask_token_id] * (S - 1))
    h = target.embed_tokens.weight.double()[block]
    pos = torch.arange(C + S, dtype=torch.float64)
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        x = norm(h, w[p + "input_layernorm.weight"])
        q = norm((x @ w[p + "self_attn.q_proj.weight"].T).view(S, H, hd), w[p + "self_attn.q_norm.weight"])
        both = torch.cat([ctx, x])
        k = norm((both @ w[p + "self_attn.k_proj.weight"].T).view(C + S, KVH, hd), w[p + "self_attn.k_norm.weight"])
        v = (both @ w[p + "self_attn.v_proj.weight"].T).view(C + S, KVH, hd)
        q, k = rope(q, pos[C:]), rope(k, pos)
        k, v = k.repeat_interleave(H // KVH, 1), v.repeat_interleave(H // KVH, 1)
        probs = (torch.einsum("shd,mhd->hsm", q, k) * hd ** -0.5).softmax(-1)
        h = h + torch.einsum("hsm,mhd->shd", probs, v).reshape(S, -1) @ w[p + "self_attn.o_proj.weight"].T
        x = norm(h, w[p + "post_attention_layernorm.weight"])
        gate, up = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
        h = h + (F.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    return norm(h[1:], w["norm.weight"]) @ target.lm_head.weight.double().T


def test_drafter_matches_reference_with_incremental_batched_context(target):
    torch.manual_seed(0)
    d = DFlashDrafter(drafter_config(), dtype=torch.float32).init_random_(1).bind(target)
    F_ = 2 * TARGET.hidden_size
    feats = [torch.randn(n, F_) for n in (7, 3)]
    cache = d.new_cache(2, 64)
    for b, f in enumerate(feats):  # prefill, one row at a time
        row = cache.row(b)
        d.append_context(row, f[None], torch.tensor([f.shape[0]], dtype=torch.int32), [f.shape[0]])
        cache.host_lens[b] = row.host_lens[0]
    for step, counts in enumerate(([2, 4], [1, 3])):  # verify steps: 4 rows of features, counts[b] accepted
        bonus = torch.tensor([5 + step, 9 + step])
        logits = d.draft(cache, bonus)
        for b in range(2):
            ref = reference_draft(d, target, torch.cat(feats[b:b + 1]), bonus[b].item())
            assert rel_err(logits[b], ref) < 1e-5
        new = torch.randn(2, 4, F_)
        d.append_context(cache, new, torch.tensor(counts, dtype=torch.int32), counts)
        feats = [torch.cat([feats[b], new[b, : counts[b]]]) for b in range(2)]
    assert cache.lens.tolist() == cache.host_lens == [f.shape[0] for f in feats]


def naive_attention(q, k_cache, v_cache, lens):
    """Per sequence and head, in float64: softmax(q k^T / sqrt(hd)) v over the first lens[b] entries."""
    B, S, H, hd = q.shape
    out = torch.empty(B, S, H, hd, dtype=torch.float64)
    for b in range(B):
        n = int(lens[b])
        k = k_cache[b, :n].double().repeat_interleave(H // k_cache.shape[2], 1)  # [n, H, hd]
        v = v_cache[b, :n].double().repeat_interleave(H // k_cache.shape[2], 1)
        probs = (torch.einsum("shd,mhd->hsm", q[b].double(), k) * hd ** -0.5).softmax(-1)
        out[b] = torch.einsum("hsm,mhd->shd", probs, v)
    return out


@pytest.mark.parametrize("device, dtype", [("cpu", torch.float32)] +
                         ([("cuda", torch.bfloat16), ("cuda", torch.float16)] if gpu() else []))
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_drafter_attention_matches_naive_softmax(device, dtype, kv_heads):
    torch.manual_seed(0)
    B, S, H, hd, L = 3, 5, 4, 32, 77
    q = torch.randn(B, S, H, hd, device=device).to(dtype)
    k_cache, v_cache = (torch.randn(B + 1, L, kv_heads, hd, device=device).to(dtype) for _ in range(2))
    lens = torch.tensor([9, 61, 33], dtype=torch.int32, device=device)
    out = ops.drafter_attention(q, k_cache, v_cache, lens, 70, hd ** -0.5)
    assert out.dtype == dtype and out.shape == q.shape
    assert rel_err(out.double().cpu(), naive_attention(q.cpu(), k_cache.cpu(), v_cache.cpu(), lens.cpu())) < (
        1e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("in_dflash_config", [False, True])
def test_checkpoint_round_trip(tmp_path, target, in_dflash_config):
    cfg = drafter_config()
    d = DFlashDrafter(cfg, dtype=torch.float32).init_random_(2).bind(target)
    write_drafter_checkpoint(tmp_path, cfg, checkpoint_tensors(d), dtype=torch.float32,
                             block_size_in_dflash_config=in_dflash_config)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert ("block_size" in hf["dflash_config"]) == in_dflash_config
    assert hf["dflash_config"]["mask_token_id"] == cfg.mask_token_id
    loaded = load_drafter(tmp_path, target, dtype=torch.float32)
    assert loaded.cfg == cfg
    for name, tensor in d.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_config_quirks_defaults():
    hf = drafter_config().to_hf()
    del hf["head_dim"], hf["num_key_value_heads"], hf["dflash_config"]["target_layer_ids"]
    hf["num_target_layers"] = 61
    hf["num_hidden_layers"] = 6
    cfg = DrafterConfig.from_hf(hf)
    assert cfg.head_dim == TARGET.hidden_size // 4 and cfg.num_key_value_heads == 4
    assert cfg.target_layer_ids == default_target_layer_ids(61, 6) == (1, 12, 24, 35, 47, 58)  # K2.5-DFlash's


@pytest.mark.parametrize("key, value, message", [
    ("attention_bias", True, "attention_bias"),
    ("layer_types", ["full_attention", "sliding_attention"], "sliding-window"),
    ("num_attention_heads", None, "missing 'num_attention_heads'"),
    ("mask_token_id", 600, "mask_token_id 600 outside"),
])
def test_unsupported_configs_are_refused(key, value, message):
    hf = drafter_config().to_hf()
    if key == "mask_token_id":
        hf["dflash_config"][key] = value
    else:
        hf[key] = value
    with pytest.raises(ValueError, match=message):
        DrafterConfig.from_hf(hf)


@pytest.mark.parametrize("change, message", [
    (dict(hidden_size=64, head_dim=16), "hidden_size"),
    (dict(vocab_size=1024), "vocab_size"),
    (dict(target_layer_ids=(0, 3)), "target_layer_ids"),
])
def test_mismatched_drafter_is_refused(change, message):
    with pytest.raises(ValueError, match=message):
        check_drafter_fits(drafter_config(**change), TARGET)


def test_checkpoint_with_wrong_shape_is_refused(tmp_path, target):
    cfg = drafter_config()
    tensors = checkpoint_tensors(DFlashDrafter(cfg, dtype=torch.float32).init_random_(0))
    tensors["fc.weight"] = tensors["fc.weight"][:, :-1]
    write_drafter_checkpoint(tmp_path, cfg, tensors)
    with pytest.raises(ValueError, match="fc.weight"):
        load_drafter(tmp_path, target)


def _draft_of(target, drafter):
    tokens = torch.arange(3, 12)[None]
    out = target(tokens, torch.arange(9)[None], target.new_cache(1, 16), hidden_layers=drafter.target_layer_ids)
    cache = drafter.new_cache(1, 32)
    drafter.append_context(cache, out.hidden, torch.tensor([9], dtype=torch.int32), [9])
    return drafter.draft(cache, torch.tensor([5]))


def _tp_drafter_rank(rank, port, target_dir, results):
    from model.checkpoint import load_model
    from model.parallel import Parallel
    from spec.default_model import DRAFTER_DIR
    from spec.drafter_checkpoint import load_drafter

    with gloo_rank(rank, port):
        target = load_model(target_dir, Parallel.from_process_group(), dtype=torch.float32, progress=False)
        drafter = load_drafter(DRAFTER_DIR, target, dtype=torch.float32)
        results[rank] = (drafter.layers[0].self_attn.heads, _draft_of(target, drafter))


def test_two_gloo_ranks_draft_like_one():
    """The drafter sharded like the target (heads, key/value heads, MLP over two gloo ranks, only each rank's
    slices read) drafts the single-rank logits."""
    from model.checkpoint import load_model
    from spec.default_model import DRAFTER_DIR, TARGET_DIR as target_dir
    from spec.drafter_checkpoint import load_drafter
    from tests.conftest import free_port

    target = load_model(target_dir, dtype=torch.float32, progress=False)
    ref = _draft_of(target, load_drafter(DRAFTER_DIR, target, dtype=torch.float32))
    results = mp.get_context("spawn").Manager().dict()
    mp.spawn(_tp_drafter_rank, args=(free_port(), str(target_dir), results), nprocs=2, join=True)
    for rank in range(2):
        heads, logits = results[rank]
        assert heads == 2 and rel_err(logits, ref) < 1e-5


def test_drafter_on_another_tp_rank_is_refused(target):
    from model.parallel import Parallel

    drafter = DFlashDrafter(drafter_config(), dtype=torch.float32, parallel=Parallel(2, 1))
    with pytest.raises(ValueError, match="tensor-parallel rank 1 of 2"):
        drafter.bind(target)
