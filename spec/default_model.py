"""The embedded default: a tiny K2.6-shaped target (preset "tiny", INT4 experts) made from a fixed seed, and a
DFlash drafter trained on that target's own greedy text, shipped in z-lab's format in spec/default_drafter/
(about 0.7 MB). Both go through the real writers and loaders. The target's weights are random, so its text
is noise; the drafter predicts it well enough to show trees being accepted several tokens deep (mean accept
length about 2), though on a CPU a model this small gains no speed from speculation.

`python -m spec.default_model` retrains the shipped drafter (a few minutes on a CPU, deterministic).
"""

import math
import random
import shutil
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from model.checkpoint import load_model
from model.checkpoint_writer import random_tensors, write_checkpoint
from model.config import preset
from model.generate import greedy_generate
from model.tokenizer import ByteTokenizer
from spec.drafter import DFlashDrafter, DrafterConfig
from spec.drafter_checkpoint import checkpoint_tensors, load_drafter, write_drafter_checkpoint

SEED = 20261129
TARGET = preset("tiny")
DRAFTER_DIR = Path(__file__).with_name("default_drafter")


def drafter_config(target_cfg=TARGET, block_size=8, layers=2):
    """A small DFlash drafter for `target_cfg`: its features from the first and last target layers, the
    byte tokenizer's [UNK] as the mask token (K2.6's drafter uses [UNK] too)."""
    return DrafterConfig(
        hidden_size=target_cfg.hidden_size, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, intermediate_size=2 * target_cfg.hidden_size, vocab_size=target_cfg.vocab_size,
        block_size=block_size, mask_token_id=ByteTokenizer(target_cfg.vocab_size).special_id("[UNK]"),
        target_layer_ids=(0, target_cfg.num_hidden_layers - 1), rope_theta=10000.0,
        max_position_embeddings=target_cfg.max_position_embeddings, num_target_layers=target_cfg.num_hidden_layers,
    )


def write_default(path, seed=SEED, target_cfg=TARGET, dcfg=None):
    """Write a seeded target checkpoint to path/target and a seeded (untrained) drafter to path/drafter."""
    path = Path(path)
    dcfg = dcfg or drafter_config(target_cfg)
    target_dir, drafter_dir = path / "target", path / "drafter"
    write_checkpoint(target_dir, target_cfg, random_tensors(target_cfg, seed), single_file=True)
    drafter = DFlashDrafter(dcfg, dtype=torch.float32).init_random_(seed + 1)
    write_drafter_checkpoint(drafter_dir, dcfg, checkpoint_tensors(drafter))
    return target_dir, drafter_dir


def load_default(dtype=torch.float32, device="cpu", seed=SEED, parallel=None):
    """(target, drafter, tokenizer) of the embedded default: the target built in a temporary directory, the
    shipped trained drafter; `parallel`: this tensor-parallel rank's shard of both."""
    with tempfile.TemporaryDirectory(prefix="kimi-ddtree-default-") as tmp:
        target_dir, _ = write_default(tmp, seed)
        target = load_model(target_dir, parallel, dtype=dtype, device=device, progress=False)
    drafter = load_drafter(DRAFTER_DIR, target, dtype=dtype, device=device)
    return target, drafter, ByteTokenizer(TARGET.vocab_size)


# --- training the shipped drafter -----------------------------------------------------------------------------

def training_data(target, layer_ids, count, new_tokens, seed):
    """Greedy continuations of `count` random byte prompts, and the target's features along each."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 256, (int(torch.randint(4, 24, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(count)]
    seqs = [p + out for p, out in zip(prompts, greedy_generate(target, prompts, new_tokens))]
    feats = [target(torch.tensor([s]), torch.arange(len(s))[None], target.new_cache(1, len(s)),
                    hidden_layers=layer_ids).hidden[0] for s in seqs]
    return [len(p) for p in prompts], seqs, feats


def draft_loss(drafter, batch, decay=0.8):
    """DFlash's objective on (features [B, C, F], context lengths [B], bonus [B], targets [B, L]): cross-entropy
    of each drafted depth, weighted decay^depth. Returns (loss, accuracy per depth [L])."""
    feats, counts, bonus, targets = batch
    cache = drafter.new_cache(feats.shape[0], feats.shape[1] + drafter.cfg.block_size)
    drafter.append_context(cache, feats, counts, counts.tolist())
    logits = drafter.draft(cache, bonus).float()  # [B, L, V]
    ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view(targets.shape)
    weights = decay ** torch.arange(targets.shape[1], dtype=torch.float32)
    return (ce * weights).sum(1).mean() / weights.sum(), (logits.argmax(-1) == targets).float().mean(0)


def sample_batch(data, size, rng, L):
    """Random anchors s: the context is the features of tokens 0..s-1, the bonus token s, the targets s+1..s+L."""
    prompt_lens, seqs, feats = data
    picks = []
    for _ in range(size):
        i = rng.randrange(len(seqs))
        picks.append((i, rng.randrange(prompt_lens[i], len(seqs[i]) - L)))
    out = torch.zeros(size, max(s for _, s in picks), feats[0].shape[-1])
    for b, (i, s) in enumerate(picks):
        out[b, :s] = feats[i][:s]
    return (out, torch.tensor([s for _, s in picks], dtype=torch.int32), torch.tensor([seqs[i][s] for i, s in picks]),
            torch.tensor([seqs[i][s + 1 : s + 1 + L] for i, s in picks]))


def train_drafter(target, drafter, data, steps=1500, batch=64, lr=3e-3, seed=0, log=print):
    """AdamW with warm-up and cosine decay on random anchors of `data` (from `training_data`)."""
    weights = [buf for name, buf in drafter.named_buffers() if name != "inv_freq"]
    for w in weights:
        w.requires_grad_(True)
    opt = torch.optim.AdamW(weights, lr=lr, weight_decay=0.0)
    rng = random.Random(seed)
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / steps))
        loss, acc = draft_loss(drafter, sample_batch(data, batch, rng, drafter.cfg.draft_len))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"step {step}: loss {loss.item():.3f}, accuracy per depth {[round(a, 2) for a in acc.tolist()]}")
    for w in weights:
        w.requires_grad_(False)
    return drafter


def main():
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        target_dir, drafter_dir = write_default(tmp)
        target = load_model(target_dir, dtype=torch.float32, progress=False)
        drafter = load_drafter(drafter_dir, target, dtype=torch.float32)
    data = training_data(target, drafter.target_layer_ids, count=1024, new_tokens=160, seed=SEED + 2)
    train_drafter(target, drafter, data, seed=SEED + 3)
    shutil.rmtree(DRAFTER_DIR, ignore_errors=True)
    write_drafter_checkpoint(DRAFTER_DIR, drafter.cfg, checkpoint_tensors(drafter))
    print(f"wrote {DRAFTER_DIR}")


if __name__ == "__main__":
    main()
