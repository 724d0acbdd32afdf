"""`python -m spec.decode`: generate text with DDTree speculative decoding (or the target alone).

With no --model-path it runs the embedded default (a tiny random K2.6-shaped target and drafter, see
spec/default_model.py). Text streams to stdout, then one stats line; --json prints one object instead.
Under `torchrun --nproc-per-node N` each process holds one tensor-parallel rank (NCCL on GPUs, gloo on CPU):
every rank runs the same steps on the same gathered logits, and rank 0 prints.
Bad input (paths, a drafter that does not fit the target, a prompt longer than the context, kernel choices,
out-of-range values) ends with one `error: ...` line on stderr and exit code 2.
"""

import argparse
import gc
import json
import os
import sys
from collections import Counter

import torch
import torch.distributed as dist

import ops
import spec.drafter  # noqa: F401 (registers the drafter_attention op before --kernels is read)
from model.parallel import Parallel
from spec.budget import LatencyTable
from spec.engine import MAX_BUDGET, TREES, Engine, SamplingParams

DEFAULT_BUDGET = "auto"


class UsageError(Exception):
    """Bad input from the command line: reported as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def parse_args(argv):
    p = _Parser(prog="python -m spec.decode", description=__doc__.splitlines()[0])
    p.add_argument("--model-path", help="K2.6-format target checkpoint directory (default: the embedded tiny model)")
    p.add_argument("--draft-model-path", help="DFlash drafter checkpoint directory (z-lab format)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="prompt token ids, comma-separated: 1,2,3")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the Kimi chat template (user turn)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tree-budget", default=DEFAULT_BUDGET,
                   help=f"draft tree nodes, 1..{MAX_BUDGET}, or auto: each step the bucket with the most expected "
                        "tokens per second (spec/budget.py)")
    p.add_argument("--tree", choices=TREES, default="ddtree",
                   help="ddtree: the best-first tree; chain: DFlash's per-depth argmax (the block's L nodes)")
    p.add_argument("--latency-table", default=None,
                   help="auto's step ms per budget (bench/bench_step.py json or spec.budget.LatencyTable json; "
                        "default: measured after load)")
    p.add_argument("--no-spec", action="store_true", help="target-only autoregressive decoding")
    p.add_argument("--kernels", default=None, help="op=backend,... e.g. moe=triton,attention=torch or all=triton")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda when present)")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="replay the verify and draft passes as CUDA graphs per tree-size bucket, captured once "
                        "after load (CUDA only; --no-cuda-graphs runs eagerly)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    args = p.parse_args(argv)
    if args.prompt is None and args.prompt_ids is None:
        raise UsageError("give a prompt: --prompt TEXT or --prompt-ids 1,2,3")
    args.tree_budget = parse_budget(args.tree_budget)
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.draft_model_path and not args.model_path:
        raise UsageError("--draft-model-path needs --model-path (the default model has its own drafter)")
    if args.model_path and not args.draft_model_path and not args.no_spec:
        raise UsageError("--model-path needs --draft-model-path (or --no-spec for the target alone)")
    try:
        SamplingParams(args.temperature, args.top_p, 0, args.seed)
    except ValueError as err:
        raise UsageError(str(err)) from None
    return args


def parse_budget(text):
    """'auto' or an int in 1..MAX_BUDGET."""
    if text == "auto":
        return text
    try:
        budget = int(text)
    except ValueError:
        budget = None
    if budget is None or not 1 <= budget <= MAX_BUDGET:
        raise UsageError(f"--tree-budget must be in 1..{MAX_BUDGET} or auto, got {text}")
    return budget


def choose_kernels(spec, device):
    if not spec:
        return
    try:
        ops.use_spec(spec)
    except ValueError as err:
        raise UsageError(f"--kernels: {err}") from None
    wants_triton = [name for name, backend in ops.table().items() if backend == "triton"]
    if wants_triton and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise UsageError(f"--kernels: {', '.join(wants_triton)} set to triton, which needs a CUDA device "
                         "(or TRITON_INTERPRET=1)")


def pick_device(name):
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"--device: unknown device {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: no CUDA device is available")
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {name}: only cpu and cuda are supported")
    return device


def join_ranks(device_name):
    """(device, Parallel) of this process: alone, or one rank of the group torchrun describes (WORLD_SIZE,
    LOCAL_RANK): NCCL with one GPU per rank when CUDA is used, gloo on the CPU."""
    device = pick_device(device_name)
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return device, Parallel()
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device, Parallel.from_process_group()


def load(args, device, parallel):
    """(target, drafter or None, tokenizer) from the paths given, or the embedded default, as this rank's shard."""
    from model.checkpoint import load_model
    from model.tokenizer import load_tokenizer
    from spec.default_model import load_default
    from spec.drafter_checkpoint import load_drafter

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.model_path is None:
        if device.type == "cpu":
            torch.set_num_threads(1)  # the tiny default's matmuls are too small to gain from threads
        target, drafter, tok = load_default(dtype, device, parallel=parallel)
        return target, None if args.no_spec else drafter, tok
    for flag, path in (("--model-path", args.model_path), ("--draft-model-path", args.draft_model_path)):
        if path is not None and not os.path.isdir(path):
            raise UsageError(f"{flag}: {path} is not a directory")
    try:
        target = load_model(args.model_path, parallel, dtype=dtype, device=device,
                            progress=not args.json and parallel.rank == 0)
        drafter = None
        if not args.no_spec:
            drafter = load_drafter(args.draft_model_path, target, dtype=dtype, device=device)
        tok = load_tokenizer(args.model_path, target.cfg.vocab_size)
    except (OSError, ValueError) as err:
        raise UsageError(str(err)) from None
    return target, drafter, tok


def prompt_ids(args, tok):
    if args.prompt_ids is not None:
        try:
            ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            raise UsageError(f"--prompt-ids: expected comma-separated integers, got {args.prompt_ids!r}") from None
        if args.chat:
            raise UsageError("--chat applies to --prompt text, not to --prompt-ids")
        return ids
    if args.chat:
        return tok.apply_chat_template([{"role": "user", "content": args.prompt}])
    return tok.encode(args.prompt, allow_special=False)


def decode_text(tok, ids):
    """Text of ids; ids the tokenizer cannot spell (a random tiny model emits any id) show as <id>, and
    control characters as U+FFFD so noise cannot drive the terminal."""
    parts, run = [], []
    for i in ids:
        try:
            tok.decode([i])
            run.append(i)
        except ValueError:
            parts += [tok.decode(run), f"<{i}>"]
            run = []
    text = "".join(parts + [tok.decode(run)])
    return "".join(c if c.isprintable() or c in "\n\t" else "\ufffd" for c in text)


class Streamer:
    """Prints the text of sequence 0 as tokens arrive, holding back a tail that ends inside a UTF-8 character
    (up to 8 tokens); the cost per step is that of the new tokens only."""

    def __init__(self, tok, out):
        self.tok, self.out, self.pending = tok, out, []

    def __call__(self, b, new_ids):
        if b:
            return
        self.pending += new_ids
        text = decode_text(self.tok, self.pending)
        if text.endswith("\ufffd") and len(self.pending) < 8:
            return
        self.out.write(text)
        self.out.flush()
        self.pending = []

    def finish(self):
        self.out.write(decode_text(self.tok, self.pending) + "\n")


def run(args):
    device, parallel = join_ranks(args.device)
    try:
        generate(args, device, parallel)
    finally:
        if parallel.joined:
            # The model and engine hold the group (through Parallel) in reference cycles. A group still alive at
            # interpreter exit is destroyed there, with its gloo threads running: the likely cause of one rank's
            # abort seen once in CI ("terminate called without an active exception"). Free the cycles first.
            gc.collect()
            dist.barrier()  # no rank tears the group down while another still talks to it
            dist.destroy_process_group()


def generate(args, device, parallel):
    choose_kernels(args.kernels, device)
    target, drafter, tok = load(args, device, parallel)
    ids = prompt_ids(args, tok)
    try:
        latency = LatencyTable.load(args.latency_table) if args.latency_table else None
        engine = Engine(target, drafter, args.tree_budget, cuda_graphs=args.cuda_graphs, tree=args.tree,
                        latency=latency)
    except ValueError as err:
        raise UsageError(f"--latency-table: {err}") from None
    try:
        engine.check_prompts([ids])
    except ValueError as err:
        raise UsageError(str(err)) from None
    sampling = SamplingParams(args.temperature, args.top_p, 0, args.seed)
    main_rank = parallel.rank == 0
    streamer = None if args.json or not main_rank else Streamer(tok, sys.stdout)
    result = engine.generate([ids], args.max_new_tokens, sampling, stop_ids=tok.stop_ids, spec=drafter is not None,
                             on_tokens=streamer)
    out, accepts = result.output_ids[0], result.accept_lengths[0]
    if not main_rank:
        return
    if args.json:
        print(json.dumps({
            "output_ids": out, "text": decode_text(tok, out), "accept_lengths": accepts,
            "mean_accept_length": result.mean_accept_length, "tokens_per_s": result.tokens_per_s,
            "steps": result.steps, "prompt_tokens": len(ids), "finish_reason": result.finish_reasons[0],
            "prefill_s": result.prefill_s, "decode_s": result.decode_s, "budgets": result.budgets,
        }))
        return
    streamer.finish()
    print(f"[{mode_label(args, drafter, result.budgets)}] {len(out)} tokens in {result.steps} steps, mean accept "
          f"length {result.mean_accept_length:.2f}, {result.tokens_per_s:.1f} tok/s (prefill "
          f"{result.prefill_s * 1e3:.0f} ms of {len(ids)} tokens, {result.finish_reasons[0]}) on {device.type}" + (f" x {parallel.tp_size} ranks" if parallel.joined else ""))


def mode_label(args, drafter, budgets):
    if drafter is None:
        return "target only"
    if args.tree == "chain":
        return f"DFlash chain of {drafter.cfg.draft_len}"
    if args.tree_budget != "auto":
        return f"DDTree budget {args.tree_budget}"
    chosen = Counter(budgets)
    return "DDTree auto (budget " + ", ".join(f"{b} x{n}" for b, n in sorted(chosen.items())) + ")"


def main(argv=None):
    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
