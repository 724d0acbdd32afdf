"""The embedded default model: a small K2.6-shaped target trained on the Python standard library's source, and a
DFlash drafter trained for it, shipped in spec/default_target/ (the K2.6 checkpoint format: MLA with the 512 + 64
latent and a q LoRA, a dense first layer, MoE layers of INT4 group-32 routed experts plus a shared expert, YaRN,
a byte vocabulary with Kimi's special tokens) and spec/default_drafter/ (z-lab's format). Both load through the
normal loaders (`load_default`).

    python -m spec.default_model train --out DIR   # retrain target and drafter from scratch (a GPU: minutes)
    python -m spec.default_model eval --out FILE   # measure the shipped pair on the held-out modules

`train` trains the target on every .py file of the standard library except `HELD_OUT` (each file is
[BOS] bytes [EOS]), writes it in the K2.6 format, generates greedy continuations with it, trains the drafter on
them with `spec.train_drafter`'s recipe, and measures the pair (`evaluate`): bits per byte on the held-out
modules, mean accept lengths of greedy DDTree at budgets 8 to 64 and of a chain, and how many greedy
continuations of held-out function headers parse. It writes DIR/default_target/, DIR/default_drafter/ and
DIR/default_model_eval.{json,md}.

`write_default` makes seeded random pairs of the tiny preset's shape (`TARGET`) for tests.
"""

import argparse
import ast
import io
import json
import math
import platform
import shutil
import sys
import sysconfig
import tempfile
import time
import tokenize
from dataclasses import dataclass, field, replace
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F

from model.checkpoint import load_model
from model.checkpoint_writer import random_tensors, write_checkpoint
from model.config import ModelConfig, preset
from model.tokenizer import ByteTokenizer
from spec.drafter import DFlashDrafter, DrafterConfig
from spec.drafter_checkpoint import checkpoint_tensors, load_drafter, write_drafter_checkpoint

SEED = 20261129
TARGET = preset("tiny")  # the shape of the seeded random pairs `write_default` writes (tests)
TARGET_DIR = Path(__file__).with_name("default_target")
DRAFTER_DIR = Path(__file__).with_name("default_drafter")
_BYTES = ByteTokenizer(512)

# The trained default's target: K2.6's architecture at a size whose checkpoint and drafter fit 16 MB.
SHIPPED_TARGET = ModelConfig(
    vocab_size=512, hidden_size=256, num_hidden_layers=6, intermediate_size=768, first_k_dense_replace=1,
    n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=128,
    num_attention_heads=4, q_lora_rank=128, kv_lora_rank=512, qk_nope_head_dim=64, qk_rope_head_dim=64,
    v_head_dim=64, rope_theta=50000.0, max_position_embeddings=4096,
    rope_scaling={"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512, "beta_fast": 32.0,
                  "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    bos_token_id=_BYTES.bos_id, eos_token_id=_BYTES.eos_id, pad_token_id=_BYTES.pad_id,
)

# Modules of the standard library (paths under its root) the target never trains on; the measurements use them.
HELD_OUT = ("base64.py", "bisect.py", "calendar.py", "colorsys.py", "difflib.py", "fnmatch.py", "fractions.py",
            "glob.py", "heapq.py", "ipaddress.py", "json/encoder.py", "queue.py", "shlex.py", "statistics.py",
            "textwrap.py")


def drafter_config(target_cfg=TARGET, block_size=8, layers=2):
    """A small DFlash drafter for `target_cfg` (the random test pairs): its features from the first and last
    target layers, the byte tokenizer's [UNK] as the mask token (K2.6's drafter uses [UNK] too)."""
    return DrafterConfig(
        hidden_size=target_cfg.hidden_size, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, intermediate_size=2 * target_cfg.hidden_size, vocab_size=target_cfg.vocab_size,
        block_size=block_size, mask_token_id=ByteTokenizer(target_cfg.vocab_size).special_id("[UNK]"),
        target_layer_ids=(0, target_cfg.num_hidden_layers - 1), rope_theta=10000.0,
        max_position_embeddings=target_cfg.max_position_embeddings, num_target_layers=target_cfg.num_hidden_layers,
    )


def shipped_drafter_config(target_cfg=SHIPPED_TARGET, block_size=8):
    """The trained default's drafter: 2 layers, features from target layers 1, 3 and 5 (the last)."""
    last = target_cfg.num_hidden_layers - 1
    return replace(drafter_config(target_cfg, block_size), head_dim=64,
                   target_layer_ids=tuple(range(1, last + 1, 2)) if last >= 1 else (0,))


def write_default(path, seed=SEED, target_cfg=TARGET, dcfg=None):
    """Write a seeded random target checkpoint to path/target and a seeded (untrained) drafter to path/drafter."""
    path = Path(path)
    dcfg = dcfg or drafter_config(target_cfg)
    target_dir, drafter_dir = path / "target", path / "drafter"
    write_checkpoint(target_dir, target_cfg, random_tensors(target_cfg, seed), single_file=True)
    drafter = DFlashDrafter(dcfg, dtype=torch.float32).init_random_(seed + 1)
    write_drafter_checkpoint(drafter_dir, dcfg, checkpoint_tensors(drafter))
    return target_dir, drafter_dir


def load_default(dtype=torch.float32, device="cpu", parallel=None):
    """(target, drafter, tokenizer) of the shipped default pair; `parallel`: this tensor-parallel rank's shard."""
    target = load_model(TARGET_DIR, parallel, dtype=dtype, device=device, progress=False)
    drafter = load_drafter(DRAFTER_DIR, target, dtype=dtype, device=device)
    return target, drafter, ByteTokenizer(target.cfg.vocab_size)


# --- the corpus -----------------------------------------------------------------------------------------------

def stdlib_root():
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root=None):
    """(training files, held-out files) of the standard library: every .py file outside site-packages, sorted by
    path; the held-out ones in HELD_OUT's order (all must exist)."""
    root = Path(root or stdlib_root())
    held = [root / name for name in HELD_OUT]
    missing = [str(p) for p in held if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"default model: held-out modules missing from {root}: {missing}")
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts) and p.is_file())
    return [p for p in files if p not in set(held)], held


def document_ids(data, tok=_BYTES):
    """A file's token ids as the target trains on them: [BOS] bytes [EOS]."""
    return [tok.bos_id, *data, tok.eos_id]


def corpus_stream(files):
    """All files' documents concatenated: 1-D int64."""
    chunks = [torch.tensor(document_ids(p.read_bytes()), dtype=torch.int64) for p in files]
    return torch.cat(chunks)


def function_headers(files, count):
    """Up to `count` prompts: the signatures (from `def` to the end of its logical line) of public top-level
    functions whose body starts on a later line, taken in turn from each file."""
    per_file = []
    for path in files:
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines(keepends=True)
        heads = []
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_") \
                    and node.body[0].lineno > node.lineno:
                segment = lines[node.lineno - 1 : node.body[0].lineno - 1]
                readline = io.StringIO("".join(segment)).readline
                end = next(t.end[0] for t in tokenize.generate_tokens(readline) if t.type == tokenize.NEWLINE)
                heads.append("".join(segment[:end]))
        per_file.append(heads)
    out = []
    for i in range(max(map(len, per_file), default=0)):
        out += [heads[i] for heads in per_file if i < len(heads)]
    return out[:count]


# --- measurements ---------------------------------------------------------------------------------------------

@torch.no_grad()
def bits_per_byte(target, files, window=512, batch=32):
    """Mean bits per byte of the files' bytes under the target, each file read after its [BOS] as in training.
    Windows of `window` tokens advance by half a window; a window scores only the tokens the previous one did
    not, so every byte after the first half-window is predicted from at least window/2 bytes of context."""
    pieces = []  # (ids of a window, index of its first scored target)
    for path in files:
        ids = document_ids(path.read_bytes())[:-1]  # [BOS] + bytes: the targets are the bytes
        stride = window // 2
        for start in range(0, max(1, len(ids) - window + stride), stride):
            chunk = ids[start : start + window]
            pieces.append((chunk, 0 if start == 0 else window - stride))
            if start + window >= len(ids):
                break
    nats, count = 0.0, 0
    for i in range(0, len(pieces), batch):
        group = pieces[i : i + batch]
        T = max(len(c) for c, _ in group)
        tokens = torch.full((len(group), T), _BYTES.pad_id, dtype=torch.int64)
        for b, (chunk, _) in enumerate(group):
            tokens[b, : len(chunk)] = torch.tensor(chunk)
        tokens = tokens.to(target.device)
        logits = target(tokens, torch.arange(T, device=target.device).expand(len(group), T),
                        target.new_cache(len(group), T)).logits.float()
        logp = F.log_softmax(logits[:, :-1], -1).gather(-1, tokens[:, 1:, None])[..., 0]  # [G, T-1]
        for b, (chunk, first) in enumerate(group):
            scored = logp[b, max(first - 1, 0) : len(chunk) - 1]
            nats -= scored.sum().item()
            count += scored.numel()
    return nats / count / math.log(2), count


class ChainDrafter:
    """A drafter whose trees are chains: each depth's top-1 token only (the others pushed to a -1e4 logit), so
    the best-first build at budget block_size - 1 follows rank 0 at every depth, as a DFlash chain does."""

    def __init__(self, drafter):
        self.inner = drafter

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def draft(self, cache, bonus):
        logits = self.inner.draft(cache, bonus)
        return torch.full_like(logits, -1e4).scatter_(-1, logits.argmax(-1, keepdim=True), 0.0)


def complete_prefix(text):
    """`text` cut after its last complete statement at the level of a top-level function's body or above: the
    end of a logical line after which the next statement starts no deeper than the one that ended (no block
    left open) and at indentation depth <= 1. '' when there is none; stops where tokenizing fails."""
    offsets = [0]
    for line in text.splitlines(keepends=True):
        offsets.append(offsets[-1] + len(line))
    cut, depth, line_depth, ended = 0, 0, None, None  # ended: (end offset, depth) of the last finished statement
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.INDENT:
                depth += 1
            elif tok.type == tokenize.DEDENT:
                depth -= 1
            elif tok.type == tokenize.NEWLINE:
                ended, line_depth = (offsets[tok.end[0] - 1] + tok.end[1], line_depth), None
            elif tok.type in (tokenize.NL, tokenize.COMMENT, tokenize.ENDMARKER):
                continue
            elif line_depth is None:  # the first token of a statement
                line_depth = depth
                if ended is not None and depth <= min(ended[1], 1):
                    cut = ended[0]
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    return text[:cut]


def sample_text(ids):
    """The text of generated byte ids up to the first id that is not a byte (a stop or other special token)."""
    end = next((i for i, t in enumerate(ids) if not 0 <= t < 256), len(ids))
    return bytes(ids[:end]).decode("utf-8", errors="replace")


def parses(text):
    """Whether `text`, cut at its last complete statement (`complete_prefix`), is non-empty valid Python."""
    prefix = complete_prefix(text)
    try:
        ast.parse(prefix)
    except (SyntaxError, ValueError):
        return False
    return bool(prefix.strip())


def evaluate(target, drafter, held_out_files, headers=20, sample_bytes=400, budgets=(8, 16, 32, 64),
             window=512, log=print):
    """The default pair's measurements on held-out modules (see the module docstring), greedy throughout; also
    how many DDTree outputs equal the target-only greedy text (all of them, but for near-ties in 16-bit)."""
    from spec.engine import Engine

    tok = ByteTokenizer(target.cfg.vocab_size)
    bpb, scored = bits_per_byte(target, held_out_files, window)
    log(f"held-out bits per byte {bpb:.4f} over {scored} bytes")
    prompts_text = function_headers(held_out_files, headers)
    prompts = [tok.encode(p, allow_special=False) for p in prompts_text]
    reference = Engine(target, None, 1, cuda_graphs=False).generate(prompts, sample_bytes, stop_ids=tok.stop_ids,
                                                                   spec=False).output_ids
    accept, same = {}, {}
    for name, budget, d in [(str(b), b, drafter) for b in budgets] + [("chain", drafter.cfg.draft_len,
                                                                          ChainDrafter(drafter))]:
        result = Engine(target, d, budget, cuda_graphs=False).generate(prompts, sample_bytes, stop_ids=tok.stop_ids)
        accept[name] = result.mean_accept_length
        same[name] = sum(out == ref for out, ref in zip(result.output_ids, reference))
        log(f"mean accept length {name}: {accept[name]:.3f} ({same[name]} of {len(prompts)} outputs equal the "
            "target-only greedy text)")
    texts = [p + sample_text(out) for p, out in zip(prompts_text, reference)]
    ok = [parses(t) for t in texts]
    log(f"{sum(ok)} of {len(ok)} greedy samples parse once cut at their last complete statement")
    return {"bits_per_byte": bpb, "scored_bytes": scored, "held_out": list(HELD_OUT), "mean_accept_length": accept,
            "equal_to_target_greedy": same, "block_size": drafter.cfg.block_size,
            "parse_fraction": sum(ok) / len(ok), "samples": len(ok),
            "sample_bytes": sample_bytes, "parsed": ok, "sample_texts": texts}


def results_markdown(results):
    acc = results["mean_accept_length"]
    budgets = [k for k in acc if k != "chain"]
    lines = [
        f"# Default model ({results.get('device', '?')}, {results.get('date', '?')})", "",
        f"torch {results.get('torch', '?')}, Triton {results.get('triton', '?')}, Python "
        f"{results.get('python', '?')}. Held-out modules: {', '.join(results['held_out'])}.", "",
        "| measure | value |", "|---|---|",
        f"| target bits per byte (held out, {results['scored_bytes']} bytes) | {results['bits_per_byte']:.3f} |",
    ]
    lines += [f"| mean accept length, greedy DDTree budget {b}, block {results['block_size']} | {acc[b]:.2f} |"
              for b in budgets]
    lines += [f"| mean accept length, chain (top-1 per depth) | {acc['chain']:.2f} |",
              f"| greedy {results['sample_bytes']}-byte samples of held-out function headers that parse | "
              f"{round(results['parse_fraction'] * results['samples'])} of {results['samples']} |"]
    for key in ("target_bytes", "drafter_bytes", "target_train_s", "target_train_bits_per_byte", "drafter_train_s"):
        if key in results:
            lines.append(f"| {key.replace('_', ' ')} | {results[key]} |")
    return "\n".join(lines) + "\n"


# --- training the pair ----------------------------------------------------------------------------------------

@dataclass
class Recipe:
    """Sizes of a `train` run (the defaults: one H100, about eight minutes in all)."""

    target_steps: int = 100_000
    target_minutes: float | None = 4.0
    target_batch: int = 64
    seq_len: int = 512
    target_lr: float = 1.5e-3
    data_sequences: int = 8192  # greedy continuations the drafter trains on, each seq_len long
    drafter: dict = field(default_factory=lambda: dict(steps=100_000, minutes=1.5, batch_size=32, anchors=64,
                                                       lr=2e-3, eval_every=500, save_every=100_000,
                                                       eval_prompts=16, eval_tokens=128))
    headers: int = 20
    sample_bytes: int = 400

    @property
    def prompt_bytes(self):
        """The training text that starts each greedy continuation."""
        return self.seq_len // 8


@torch.no_grad()
def greedy_continuations(target, stream, count, prompt_bytes, new_tokens, seed, batch=1024):
    """`count` sequences: a prompt of prompt_bytes from `stream` starting at a line start (random, seeded), then
    the target's greedy continuation of new_tokens, as spec.train_drafter Sequences (only the continuation is
    drafted). Prompts share one length, so each batch prefills in one pass."""
    from spec.train_drafter import Sequence

    if prompt_bytes < 1 or new_tokens < 1:
        raise ValueError(f"greedy_continuations: need a prompt and new tokens, got {prompt_bytes} and {new_tokens}")

    gen = torch.Generator().manual_seed(seed)
    cpu = stream.cpu()
    starts = []
    newlines = (cpu[:-prompt_bytes - 1] == ord("\n")).nonzero()[:, 0]
    for i in torch.randint(len(newlines), (count,), generator=gen).tolist():
        starts.append(newlines[i].item() + 1)
    out = []
    for i in range(0, count, batch):
        prompts = torch.stack([cpu[s : s + prompt_bytes] for s in starts[i : i + batch]]).to(target.device)
        B = prompts.shape[0]
        cache = target.new_cache(B, prompt_bytes + new_tokens)
        positions = torch.arange(prompt_bytes, device=target.device).expand(B, -1)
        logits = target(prompts, positions, cache, logit_rows=torch.full((B, 1), prompt_bytes - 1,
                                                                          device=target.device)).logits
        cache.advance([prompt_bytes] * B)
        tokens = [logits[:, -1].argmax(-1)]
        for t in range(new_tokens - 1):
            step = torch.full((B, 1), prompt_bytes + t, device=target.device)
            logits = target(tokens[-1][:, None], step, cache).logits
            cache.advance([1] * B)
            tokens.append(logits[:, -1].argmax(-1))
        ids = torch.cat([prompts, torch.stack(tokens, 1)], 1).tolist()
        out += [Sequence(row, [False] * prompt_bytes + [True] * new_tokens) for row in ids]
    return out


def train_target_stage(stream, out_dir, recipe, device, target_cfg, log):
    """Train the target on `stream` (the training files' documents) and write it to out_dir; returns
    (seconds, the last logged training loss in bits per byte)."""
    from spec.train_target import TrainableTarget, train_target

    model = TrainableTarget(target_cfg).init_weights_(SEED).to(device)
    start = time.perf_counter()
    history = train_target(model, stream, recipe.target_steps, recipe.target_minutes, recipe.target_batch,
                           recipe.seq_len, recipe.target_lr, seed=SEED, log=log, log_every=250)
    seconds = time.perf_counter() - start
    size = model.export(out_dir)
    log(f"target written to {out_dir}: {size} bytes after {history[-1][0]} steps, {seconds:.0f} s")
    return seconds, history[-1][1] / math.log(2)


def train_drafter_stage(target, stream, out_dir, recipe, dcfg, held_out, log):
    """Generate the target's greedy text and train the drafter on it; copy its checkpoint into out_dir."""
    from spec.train_drafter import TrainOptions, train

    start = time.perf_counter()
    sequences = greedy_continuations(target, stream, recipe.data_sequences, recipe.prompt_bytes,
                                     recipe.seq_len - recipe.prompt_bytes, SEED + 1)
    log(f"drafter data: {len(sequences)} greedy continuations in {time.perf_counter() - start:.0f} s")
    opts = TrainOptions(**{**recipe.drafter, "seq_len": recipe.seq_len, "seed": SEED + 2})
    prompts = [_BYTES.encode(p, allow_special=False) for p in function_headers(held_out, opts.eval_prompts)]
    with tempfile.TemporaryDirectory(prefix="kimi-ddtree-drafter-") as work:
        train(target, sequences, prompts, dcfg, opts, work, stop_ids=_BYTES.stop_ids, log=log, progress=False)
        out_dir.mkdir(parents=True, exist_ok=True)
        for name in ("config.json", "model.safetensors"):
            shutil.copy(Path(work) / name, out_dir / name)
    return time.perf_counter() - start


def train_default(out, recipe=None, device="cpu", target_cfg=SHIPPED_TARGET, dcfg=None, target_from=None,
                  log=print):
    """The whole pipeline: target, drafter, measurements, into out/default_target, out/default_drafter and
    out/default_model_eval.{json,md}. target_from: reuse that target checkpoint instead of training one."""
    recipe, out, device = recipe or Recipe(), Path(out), torch.device(device)
    dcfg = dcfg or shipped_drafter_config(target_cfg)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target_dir, drafter_dir = out / "default_target", out / "default_drafter"
    train_files, held_out = stdlib_files()
    stream = corpus_stream(train_files).to(device)
    log(f"corpus: {len(train_files)} files of {stdlib_root()}, {stream.numel()} tokens; held out: {len(held_out)}")
    results = {}
    if target_from is None:
        seconds, bits = train_target_stage(stream, target_dir, recipe, device, target_cfg, log)
        results.update(target_train_s=round(seconds), target_train_bits_per_byte=round(bits, 4))
    else:
        shutil.copytree(target_from, target_dir, dirs_exist_ok=True)
    target = load_model(target_dir, dtype=dtype, device=device, progress=False)
    results["drafter_train_s"] = round(train_drafter_stage(target, stream, drafter_dir, recipe, dcfg, held_out, log))
    drafter = load_drafter(drafter_dir, target, dtype=dtype, device=device)
    results.update(evaluate(target, drafter, held_out, recipe.headers, recipe.sample_bytes, log=log))
    results.update(describe(device, target_dir, drafter_dir))
    write_results(results, out / "default_model_eval")
    return results


def describe(device, target_dir, drafter_dir):
    import triton

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {"device": name, "torch": torch.__version__, "triton": triton.__version__,
            "python": platform.python_version(), "date": date.today().isoformat(),
            "target_bytes": folder_bytes(target_dir), "drafter_bytes": folder_bytes(drafter_dir)}


def folder_bytes(path):
    return sum(f.stat().st_size for f in Path(path).iterdir())


def write_results(results, stem):
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    stem.with_suffix(".md").write_text(results_markdown(results))


# --- the command line -----------------------------------------------------------------------------------------

def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m spec.default_model", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="retrain target and drafter from scratch, then measure them")
    t.add_argument("--out", required=True, help="directory for default_target/, default_drafter/ and the results")
    t.add_argument("--target-from", help="reuse this target checkpoint (train only the drafter)")
    defaults = Recipe()
    t.add_argument("--target-minutes", type=float, default=defaults.target_minutes)
    t.add_argument("--target-steps", type=int, default=defaults.target_steps)
    t.add_argument("--target-batch", type=int, default=defaults.target_batch)
    t.add_argument("--seq-len", type=int, default=defaults.seq_len)
    t.add_argument("--data-sequences", type=int, default=defaults.data_sequences)
    t.add_argument("--drafter-minutes", type=float, default=defaults.drafter["minutes"])
    t.add_argument("--drafter-steps", type=int, default=defaults.drafter["steps"])
    t.add_argument("--drafter-batch", type=int, default=defaults.drafter["batch_size"])
    e = sub.add_parser("eval", help="measure a pair (default: the shipped one)")
    e.add_argument("--out", required=True, help="results file stem: writes STEM.json and STEM.md")
    e.add_argument("--target", default=str(TARGET_DIR))
    e.add_argument("--drafter", default=str(DRAFTER_DIR))
    for q in (t, e):
        q.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
        q.add_argument("--kernels", help="op=backend,... as in spec.decode (default: Triton on a GPU)")
    args = p.parse_args(argv)
    if args.kernels:
        import ops

        try:
            ops.use_spec(args.kernels)
        except ValueError as err:
            p.exit(2, f"error: --kernels: {err}\n")
    if args.command == "train":
        recipe = Recipe(target_minutes=args.target_minutes, target_steps=args.target_steps,
                        target_batch=args.target_batch, seq_len=args.seq_len, data_sequences=args.data_sequences)
        recipe.drafter.update(minutes=args.drafter_minutes, steps=args.drafter_steps, batch_size=args.drafter_batch)
        results = train_default(args.out, recipe, args.device, target_from=args.target_from)
    else:
        device = torch.device(args.device)
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        target = load_model(args.target, dtype=dtype, device=device, progress=False)
        drafter = load_drafter(args.drafter, target, dtype=dtype, device=device)
        results = evaluate(target, drafter, stdlib_files()[1])
        results.update(describe(device, args.target, args.drafter))
        write_results(results, Path(args.out).with_suffix(""))
    print(results_markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
