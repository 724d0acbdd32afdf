"""The torch references and the backend table of src/ops."""

import math
import os
import subprocess
import sys

import pytest
import torch

import ops
from model.config import ModelConfig
from tests.conftest import rel_err


def test_yarn_matches_hf_transformers():
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = ModelConfig()
    hf = DeepseekV3Config(
        hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_attention_heads, qk_rope_head_dim=64,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters={"rope_type": "yarn", "rope_theta": cfg.rope_theta, **cfg.rope_scaling},
    )
    inv_hf, factor_hf = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    inv, factor = ops.yarn_inv_freq(64, cfg.rope_theta, cfg.rope_scaling)
    assert torch.equal(inv, inv_hf.float()) and factor == factor_hf == 1.0


def test_k26_softmax_scale():
    assert math.isclose(ModelConfig().softmax_scale, 0.144680, rel_tol=1e-5)


def test_rope_rotates_interleaved_pairs_and_keeps_dot_products_relative():
    torch.manual_seed(0)
    inv, _ = ops.yarn_inv_freq(64, 50000.0, None)
    q, k = torch.randn(1, 3, 64, dtype=torch.float64), torch.randn(1, 3, 64, dtype=torch.float64)
    dots = []
    for shift in (0, 17):
        pq = torch.tensor([5 + shift]), torch.tensor([2 + shift])
        rq = ops.apply_rope(q, pq[0], inv.double())
        rk = ops.apply_rope(k, pq[1], inv.double())
        dots.append((rq * rk).sum(-1))
    assert torch.allclose(dots[0], dots[1])  # depends on the distance only
    out = ops.apply_rope(q, torch.tensor([1]), inv.double())
    c, s = math.cos(inv[0].item()), math.sin(inv[0].item())
    assert torch.allclose(out[0, :, 0], q[0, :, 0] * c - q[0, :, 1] * s)
    assert torch.allclose(out[0, :, 1], q[0, :, 1] * c + q[0, :, 0] * s)


def test_rms_norm_reference():
    x, w = torch.randn(5, 33, dtype=torch.float64), torch.randn(33, dtype=torch.float64)
    ref = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w
    assert rel_err(ops.rms_norm(x, w, 1e-6), ref) < 1e-6
    with pytest.raises(ValueError, match="last dim"):
        ops.rms_norm(x, w[:32], 1e-6)


@pytest.mark.parametrize("n_group,topk_group", [(1, 1), (4, 2)])
def test_router_matches_hf(n_group, topk_group):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    torch.manual_seed(1)
    hf_cfg = DeepseekV3Config(hidden_size=64, n_routed_experts=16, num_experts_per_tok=4, n_group=n_group,
                              topk_group=topk_group, routed_scaling_factor=2.827, norm_topk_prob=True)
    router = DeepseekV3TopkRouter(hf_cfg)
    router.weight.data.normal_()
    router.e_score_correction_bias.normal_(0, 0.5)
    x = torch.randn(37, 64)
    _, hf_w, hf_ids = router(x)
    w, ids = ops.route(x, router.weight, router.e_score_correction_bias, 4, n_group, topk_group, 2.827)
    order_hf, order = hf_ids.sort(-1), ids.long().sort(-1)
    assert torch.equal(order.values, order_hf.values)
    assert torch.allclose(w.gather(1, order.indices), hf_w.gather(1, order_hf.indices), rtol=1e-6)


def test_int4_pack_roundtrip_and_layout():
    q = torch.randint(-8, 8, (3, 5, 64))
    packed = ops.pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (3, 5, 8)
    # element i of a row sits in word i // 8 at bits 4 * (i % 8), stored as q + 8
    assert ((packed[0, 0, 0].item() >> 4) & 0xF) - 8 == q[0, 0, 1].item()
    scale = torch.rand(3, 5, 2) + 0.5
    assert torch.equal(ops.unpack_int4(packed, scale), q.float() * scale.repeat_interleave(32, -1))


def test_moe_reference_matches_dense_loop():
    torch.manual_seed(2)
    E, D, I, M, k = 5, 64, 32, 9, 2
    gu_q, d_q = torch.randint(-8, 8, (E, 2 * I, D)), torch.randint(-8, 8, (E, D, I))
    gu_s, d_s = torch.rand(E, 2 * I, D // 32) / 50, torch.rand(E, D, I // 32) / 50
    experts = ops.prepare_moe(ops.pack_int4(gu_q), gu_s, ops.pack_int4(d_q), d_s)
    x, ids = torch.randn(M, D), torch.randint(0, E, (M, k), dtype=torch.int32)
    ids[:, 1] = (ids[:, 0] + 1) % E
    weights = torch.rand(M, k)
    out = ops.moe(x, ids, weights, experts)
    ref = torch.zeros(M, D, dtype=torch.float64)
    for m in range(M):
        for j in range(k):
            e = ids[m, j].item()
            wgu = gu_q[e].double() * gu_s[e].double().repeat_interleave(32, -1)
            wd = d_q[e].double() * d_s[e].double().repeat_interleave(32, -1)
            g, u = (wgu @ x[m].double()).chunk(2)
            ref[m] += weights[m, j].double() * (wd @ (torch.nn.functional.silu(g) * u))
    assert rel_err(out, ref) < 1e-5


def test_attention_reference_masks_tree_and_prefix():
    torch.manual_seed(3)
    B, T, H, L = 2, 3, 2, 8
    q, kv = torch.randn(B, T, H, 576, dtype=torch.float64), torch.randn(B, 10, 576, dtype=torch.float64)
    lens = torch.tensor([L, L - 2], dtype=torch.int32)
    visible = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool).expand(B, T, T)
    out = ops.mla_attention(q, kv, lens, ops.pack_tree_mask(visible), 0.1)
    for b in range(B):
        n = lens[b].item()
        for t in range(T):
            cols = list(range(n - T)) + [n - T + j for j in range(T) if visible[b, t, j]]
            keys = kv[b, cols]
            p = ((keys @ q[b, t].T) * 0.1).softmax(0)  # [cols, H]
            assert rel_err(out[b, t], p.T @ keys[:, :512]) < 1e-5


def test_tree_mask_pack_roundtrip_over_word_boundaries():
    dense = torch.rand(2, 70, 70) < 0.5
    assert torch.equal(ops.tree_mask_dense(ops.pack_tree_mask(dense), 70), dense)


def test_write_kv_places_entries_per_sequence():
    cache = torch.zeros(2, 6, 4)
    entries = torch.arange(2 * 2 * 4, dtype=torch.float32).view(2, 2, 4)
    ops.write_kv(cache, entries, torch.tensor([1, 3], dtype=torch.int32))
    assert torch.equal(cache[0, 1:3], entries[0]) and torch.equal(cache[1, 3:5], entries[1])
    assert cache[0, 0].abs().sum() == 0 and cache[1, :3].abs().sum() == 0


def test_backend_table_choices_and_errors():
    assert set(ops.table().values()) <= {"torch", "triton"}
    with pytest.raises(ValueError, match="unknown op"):
        ops.use(nope="torch")
    with pytest.raises(ValueError, match="unknown backend"):
        ops.use(moe="cuda")
    with pytest.raises(ValueError, match="op=backend"):
        ops.use_spec("moe")
    assert not ops.has_triton("drafter_attention")
    with pytest.raises(ValueError, match="no Triton kernel"):
        ops.use(drafter_attention="triton")
    with ops.using(moe="torch"):
        assert ops.current("moe") == "torch"
    ops.use_spec("all=torch")
    assert set(ops.table().values()) == {"torch"}
    ops.use_spec("all=triton")  # every op that has a kernel; the others keep their reference
    assert ops.table() == {n: "triton" if ops.has_triton(n) else "torch" for n in ops.op_names()}


def test_backend_from_environment():
    code = "import ops; print(ops.current('attention'))"
    env = {**os.environ, "SPEC_KERNELS": "attention=torch"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "torch"
    env["SPEC_KERNELS"] = "attention=bogus"
    bad = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert bad.returncode != 0 and "unknown backend" in bad.stderr


def test_default_backend_follows_device_and_dtype(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert ops.current("rms_norm", "cpu") == "torch"
    assert ops.current("rms_norm", "cuda") == "triton"
    assert ops.current("moe", "cuda", torch.bfloat16) == "triton"
    assert ops.current("moe", "cuda", torch.float32) == "torch"  # the kernel takes 16-bit activations
    assert ops.current("prepare_moe", "cuda", torch.float32) == "torch"  # follows moe
    with ops.using(moe="triton"):
        assert ops.current("moe", "cpu", torch.float32) == "triton"  # an explicit choice always wins
