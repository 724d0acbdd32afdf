"""Greedy generation with the latent cache equals HF transformers' greedy `generate` on the same checkpoint."""

import pytest
import torch

from model.checkpoint import load_model
from model.generate import greedy_generate
from tests.test_model_vs_hf import hf_checkpoint, one_thread  # noqa: F401 (autouse fixture)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    path = tmp_path_factory.mktemp("gen") / "ckpt"
    cfg, hf = hf_checkpoint("tiny", path, seed=4)
    return cfg, hf, load_model(path, dtype=torch.float32, progress=False)


def hf_greedy(hf, prompt, n):
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                      eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def test_greedy_equals_hf_generate_batched(pair):
    cfg, hf, ours = pair
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist() for n in (9, 4)]
    got = greedy_generate(ours, prompts, 20)
    for prompt, tokens in zip(prompts, got):
        assert tokens == hf_greedy(hf, prompt, 20)


def test_stops_per_sequence_and_at_the_cache_end(pair):
    _, _, ours = pair
    prompts = [[5, 6, 7], [8, 9]]
    full = greedy_generate(ours, prompts, 8)
    stop = full[0][2]
    got = greedy_generate(ours, prompts, 8, stop_ids=[stop])
    assert got[0] == full[0][: full[0].index(stop) + 1]
    second_stop = full[1].index(stop) + 1 if stop in full[1] else 8
    assert got[1] == full[1][:second_stop]
    short = greedy_generate(ours, prompts, 8, max_len=5)  # 5 entries: 3 new tokens after 3, 4 after 2
    assert short == [full[0][:3], full[1][:4]]
    assert greedy_generate(ours, prompts, 0) == [[], []]


def test_prompt_longer_than_the_cache_raises(pair):
    _, _, ours = pair
    with pytest.raises(ValueError, match="prompt 1 has 6 tokens; the cache holds 1..5"):
        greedy_generate(ours, [[1, 2], [1, 2, 3, 4, 5, 6]], 4, max_len=5)
    with pytest.raises(ValueError, match="prompt 0 has 0 tokens"):
        greedy_generate(ours, [[]], 4)
