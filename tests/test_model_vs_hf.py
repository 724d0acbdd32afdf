"""Our model, loaded from a K2.6-format INT4 checkpoint, against HF transformers' DeepseekV3ForCausalLM holding
the same (dequantised) weights: prefill logits, cached decode, and tensor parallelism over two gloo ranks."""


import pytest
import torch
import torch.multiprocessing as mp

from model.checkpoint import load_model
from model.checkpoint_writer import random_tensors, write_checkpoint
from model.config import preset
from model.parallel import Parallel
from tests.conftest import free_port, gloo_rank, rel_err

PRESETS = ("tiny", "tiny-grouped")
FP32_BOUND = 1e-5  # both sides in fp32 on the same weights: measured 5e-7 to 6e-7 (prefill and cached decode)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matmuls on a shared 2-core machine run ~100x faster without intra-op threads (which spin-wait)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def hf_config(cfg):
    """Our ModelConfig as an HF DeepseekV3Config (fp32, eager attention, interleaved RoPE)."""
    from transformers import DeepseekV3Config

    rope = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling:
        scaling = {k: v for k, v in cfg.rope_scaling.items() if k != "type"}
        rope = {"rope_type": cfg.rope_scaling["type"], "rope_theta": cfg.rope_theta, **scaling}
    same = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
            "num_attention_heads", "n_shared_experts", "n_routed_experts", "routed_scaling_factor", "kv_lora_rank",
            "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "n_group", "topk_group",
            "num_experts_per_tok", "first_k_dense_replace", "norm_topk_prob", "max_position_embeddings",
            "rms_norm_eps", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")
    hf = DeepseekV3Config(**{k: getattr(cfg, k) for k in same}, num_key_value_heads=cfg.num_attention_heads,
                          rope_parameters=rope, rope_interleave=True, attention_bias=False,
                          attn_implementation="eager")
    return hf


def hf_checkpoint(name, path, seed=0, prefix="language_model."):
    """A random fp32 HF model whose experts are INT4-quantised into a K2.6 checkpoint at `path`; the HF model
    then holds exactly the checkpoint's (dequantised, bf16-rounded) weights."""
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    cfg = preset(name)
    hf = DeepseekV3ForCausalLM(hf_config(cfg)).float().eval()
    with torch.no_grad():
        for key, t in hf.state_dict().items():
            if "norm" in key:
                t.copy_(1.0 + 0.1 * torch.randn_like(t))
            elif key.endswith("e_score_correction_bias"):
                t.copy_(0.1 * torch.randn_like(t))
    stored = write_checkpoint(path, cfg, hf.state_dict(), shard_size_bytes=400_000, prefix=prefix)
    hf.load_state_dict(stored, strict=True)
    return cfg, hf


@pytest.fixture(scope="module", params=PRESETS)
def pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "ckpt"
    cfg, hf = hf_checkpoint(request.param, path)
    return cfg, hf, load_model(path, dtype=torch.float32, progress=False)


def prompt(cfg, n, seed=1):
    return torch.randint(0, cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))


def test_prefill_logits_match_hf(pair):
    cfg, hf, ours = pair
    tokens = prompt(cfg, 13)
    with torch.no_grad():
        ref = hf(tokens).logits
    cache = ours.new_cache(1, 16)
    out = ours(tokens, torch.arange(13)[None], cache).logits
    assert rel_err(out, ref) < FP32_BOUND


def test_cached_decode_matches_hf_full_sequence(pair):
    cfg, hf, ours = pair
    tokens = prompt(cfg, 13, seed=2)
    with torch.no_grad():
        ref = hf(tokens).logits[0]
    cache = ours.new_cache(1, 13)
    logits = [ours(tokens[:, :5], torch.arange(5)[None], cache).logits[0]]
    cache.advance([5])
    for t in range(5, 13):
        logits.append(ours(tokens[:, t : t + 1], torch.tensor([[t]]), cache).logits[0])
        cache.advance([1])
    out = torch.cat(logits)
    assert rel_err(out[5:], ref[5:]) < FP32_BOUND
    assert rel_err(out, ref) < FP32_BOUND


def _tp_rank(rank, port, path, tokens, results):
    with gloo_rank(rank, port):
        model = load_model(path, Parallel.from_process_group(), dtype=torch.float32, progress=False)
        cache = model.new_cache(1, tokens.shape[1])
        results[rank] = model(tokens, torch.arange(tokens.shape[1])[None], cache).logits


def test_two_gloo_ranks_match_one(tmp_path):
    """Two processes joined by a gloo group, each loading its TP shard, give the single-rank logits."""
    cfg = preset("tiny")
    write_checkpoint(tmp_path / "ckpt", cfg, random_tensors(cfg, seed=6), shard_size_bytes=300_000)
    ours = load_model(tmp_path / "ckpt", dtype=torch.float32, progress=False)
    tokens = prompt(cfg, 7, seed=3)
    ref = ours(tokens, torch.arange(7)[None], ours.new_cache(1, 7)).logits
    results = mp.get_context("spawn").Manager().dict()
    mp.spawn(_tp_rank, args=(free_port(), str(tmp_path / "ckpt"), tokens, results), nprocs=2, join=True)
    for rank in range(2):
        assert rel_err(results[rank], ref) < 1e-5
