"""`python -m spec.decode`: generate text with DDTree speculative decoding (or the target alone).

With no --model-path it runs the embedded default (a tiny random K2.6-shaped target and drafter, see
spec/default_model.py). Text streams to stdout, then one stats line; --json prints one object instead.
Under `torchrun --nproc-per-node N` each process holds one tensor-parallel rank (NCCL on GPUs, gloo on CPU):
every rank runs the same steps on the same gathered logits, and rank 0 prints.

Exit codes, each failure reported as one `error: ...` line on stderr (no traceback):
- 2, bad input: paths, config files, checkpoints that do not match their config, a drafter that does not fit
  the target, a prompt longer than the context, kernel choices (also SPEC_KERNELS), out-of-range values, a
  torchrun environment that is incomplete;
- 1, a runtime failure: out of memory (with the sizes), NaN or inf logits, a tensor-parallel rank that died
  or stopped answering within --collective-timeout, stdout that cannot be written (a full disk); a reader
  that closed the pipe (`| head -c1`) ends the run quietly, also with 1;
- 130, Ctrl-C: generation stops at once, the text so far stays, and the stats line (or JSON) reports it.
"""

import argparse
import gc
import io
import json
import math
import os
import re
import signal
import sys
import time
from collections import Counter
from datetime import timedelta

import torch
import torch.distributed as dist

import ops
from model.memory import OutOfMemory, size_text
from model.parallel import CollectiveError, Parallel, collective_failure
from spec.budget import LatencyTable
from spec.engine import MAX_BUDGET, TREES, Engine, NonFiniteLogits, SamplingError, SamplingParams

DEFAULT_BUDGET = 32  # the fixed tree budget where auto is not wired in (spec.serve's continuous batching)


class UsageError(Exception):
    """Bad input from the command line: reported as one line, exit code 2."""


class StdoutClosed(Exception):
    """The reader of stdout went away (`| head -c1`): the run stops quietly."""


class OutputError(Exception):
    """stdout cannot be written (a full disk): one line, exit code 1."""


SAMPLING_FLAGS = {"temperature": "--temperature", "top_p": "--top-p", "seed": "--seed"}


class Parser(argparse.ArgumentParser):
    """argparse that raises UsageError (one `error:` line, exit 2) instead of printing usage and exiting."""

    def error(self, message):
        raise UsageError(message)


def parse_args(argv):
    p = Parser(prog="python -m spec.decode", description=__doc__.splitlines()[0])
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
    p.add_argument("--tree-budget", default="auto",
                   help=f"draft tree nodes, 1..{MAX_BUDGET}, or auto (default): each step the budget with the most "
                        "expected tokens per second (spec/budget.py)")
    p.add_argument("--tree", choices=TREES, default="ddtree",
                   help="ddtree: the best-first tree; chain: DFlash's per-depth argmax (the block's L nodes)")
    p.add_argument("--latency-table", default=None,
                   help="auto's step ms per budget (bench/bench_step.py json or spec.budget.LatencyTable json; "
                        "default: measured before the first step)")
    p.add_argument("--no-spec", action="store_true", help="target-only autoregressive decoding")
    p.add_argument("--kernels", default=None, help="op=backend,... e.g. moe=triton,attention=torch or all=triton")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda when present)")
    add_kernel_configs(p)
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="replay the verify and draft passes as CUDA graphs per tree-size bucket, captured once "
                        "after load (CUDA only; --no-cuda-graphs runs eagerly)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_collective_timeout(p)
    args = p.parse_args(argv)
    if args.prompt is None and args.prompt_ids is None:
        raise UsageError("give a prompt: --prompt TEXT or --prompt-ids 1,2,3")
    args.tree_budget = parse_budget(args.tree_budget)
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    check_model_paths(args)
    choose_kernel_configs(args.kernel_configs, args.device)
    try:
        SamplingParams(args.temperature, args.top_p, 0, args.seed)
    except SamplingError as err:
        raise UsageError(f"{SAMPLING_FLAGS[err.field]} {err.problem}") from None
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


def check_model_paths(args):
    """The target and drafter flags go together (the embedded default brings its own drafter)."""
    if args.draft_model_path and not args.model_path:
        raise UsageError("--draft-model-path needs --model-path (the default model has its own drafter)")
    if args.model_path and not args.draft_model_path and not args.no_spec:
        raise UsageError("--model-path needs --draft-model-path (or --no-spec for the target alone)")


def positive_seconds(text):
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def add_collective_timeout(parser):
    """--collective-timeout, shared by the CLI and the server."""
    parser.add_argument("--collective-timeout", type=positive_seconds, default=600.0, metavar="SECONDS",
                        help="under torchrun: how long a rank waits for the others (joining, or in one collective) "
                             "before it gives up with an error (default 600)")


def choose_kernels(kernels, device):
    """Apply --kernels over SPEC_KERNELS; refuse a bad value of either, or Triton without a device to run it."""
    if ops.env_problem():
        raise UsageError(ops.env_problem())
    if kernels:
        try:
            ops.use_spec(kernels)
        except ValueError as err:
            raise UsageError(f"--kernels: {err}") from None
    wants_triton = [name for name, backend in ops.table(device).items() if backend == "triton"]
    if wants_triton and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise UsageError(f"--kernels / SPEC_KERNELS: {', '.join(wants_triton)} set to triton, which needs a CUDA "
                         "device (or TRITON_INTERPRET=1)")


def add_kernel_configs(parser):
    parser.add_argument("--kernel-configs", default=None, metavar="FILE",
                        help="tuned kernel configs (python -m bench.tune) over SPEC_KERNEL_CONFIGS and the shipped "
                             "ones; 'defaults': the Python tables")


def choose_kernel_configs(path, device_name):
    """Take the tuned kernel configs of --kernel-configs (else SPEC_KERNEL_CONFIGS's or the shipped ones) and check
    them now for the arch in force on the device: a bad file or one for another arch is one `error:` line."""
    try:
        device = torch.device(device_name) if device_name else None
    except RuntimeError:
        device = None  # a bad --device: pick_device says so
    try:
        ops.use_kernel_configs(path, device)
    except ValueError as err:
        raise UsageError(f"--kernel-configs: {err}" if path else str(err)) from None


def pick_device(name):
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UsageError(f"--device: unknown device {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: no CUDA device is available")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise UsageError(f"--device {name}: there are {torch.cuda.device_count()} CUDA devices")
    if device.type not in ("cpu", "cuda") or device.type == "cpu" and device.index not in (None, 0):
        raise UsageError(f"--device {name}: only cpu and cuda[:N] are supported")
    return device


def _env_int(name, low, high):
    raw = os.environ[name]
    try:
        value = int(raw)
    except ValueError:
        raise UsageError(f"{name}={raw!r} is not an integer") from None
    if not low <= value <= high:
        raise UsageError(f"{name}={value} is out of range {low}..{high}")
    return value


def torchrun_env():
    """(world size, rank, local rank) from the variables torchrun sets, or (1, 0, 0) without WORLD_SIZE; a
    UsageError when they are malformed or incomplete (WORLD_SIZE set by hand, without torchrun)."""
    if "WORLD_SIZE" not in os.environ or _env_int("WORLD_SIZE", 1, 2**16) == 1:
        return 1, 0, 0
    world = int(os.environ["WORLD_SIZE"])
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
    if missing:
        raise UsageError(f"WORLD_SIZE={world} is set but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                         f"not: start the ranks with torchrun --nproc-per-node {world} -m spec.decode ..., or unset "
                         "WORLD_SIZE")
    rank = _env_int("RANK", 0, world - 1)
    _env_int("MASTER_PORT", 1, 65535)
    local = _env_int("LOCAL_RANK", 0, world - 1) if os.environ.get("LOCAL_RANK") else rank
    return world, rank, local


def join_ranks(device_name, timeout_s):
    """(device, Parallel) of this process: alone, or one rank of the group torchrun describes (WORLD_SIZE,
    RANK, LOCAL_RANK): NCCL with one GPU per rank when CUDA is used, gloo on the CPU. Every collective of the
    group, and joining it, gives up after timeout_s."""
    device = pick_device(device_name)
    world, rank, local = torchrun_env()
    if world == 1:
        return device, Parallel()
    if device.type == "cuda":
        if local >= torch.cuda.device_count():
            raise UsageError(f"LOCAL_RANK={local}, but there are {torch.cuda.device_count()} CUDA devices")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    try:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, ValueError) as err:
        raise collective_failure(Parallel(world, rank), f"joining the group at {os.environ['MASTER_ADDR']}:"
                                 f"{os.environ['MASTER_PORT']} within {timeout_s:g} s", err) from None
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
    return tok.encode(args.prompt)


def spell(tok, ids):
    """The tokenizer's text of ids, an id it cannot spell (a random model emits any id) shown as <id>."""
    parts, run = [], []
    for i in ids:
        try:
            tok.decode([i])
            run.append(i)
        except ValueError:
            parts += [tok.decode(run), f"<{i}>"]
            run = []
    return "".join(parts + [tok.decode(run)])


def decode_text(tok, ids):
    """`spell`'s text with control characters as U+FFFD, so that noise cannot drive the terminal."""
    return "".join(c if c.isprintable() or c in "\n\t" else "\ufffd" for c in spell(tok, ids))


def write_out(text):
    """Write and flush `text` to stdout: StdoutClosed when its reader went away, OutputError when the write
    fails otherwise (a full disk), instead of an OSError traceback."""
    if sys.stdout is None:
        raise OutputError("cannot write to stdout: it is closed")
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        raise StdoutClosed from None
    except OSError as err:
        raise OutputError(f"cannot write to stdout: {err.strerror or err}") from None


def silence_stdout():
    """Point file descriptor 1 at /dev/null, so the interpreter's last flush of what stdout could not take
    stays quiet."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass


class Streamer:
    """Prints the text of sequence 0 as tokens arrive, holding back a tail that ends inside a UTF-8 character
    (up to 8 tokens); the cost per step is that of the new tokens only."""

    def __init__(self, tok):
        self.tok, self.pending = tok, []

    def __call__(self, b, new_ids):
        if b:
            return
        self.pending += new_ids
        text = decode_text(self.tok, self.pending)
        if text.endswith("\ufffd") and len(self.pending) < 8:
            return
        write_out(text)
        self.pending = []

    def finish(self):
        write_out(decode_text(self.tok, self.pending) + "\n")
        self.pending = []


class Progress:
    """The engine's on_tokens: records sequence 0's tokens and tokens per step (the first call is the prefill's
    token) and passes them on, so a run stopped midway can still report what it made."""

    def __init__(self, forward=None):
        self.forward, self.ids, self.accepts = forward, [], []
        self.start, self.first_at = time.perf_counter(), None

    def __call__(self, b, new_ids):
        if b == 0:
            if self.first_at is None:
                self.first_at = time.perf_counter()
            else:
                self.accepts.append(len(new_ids))
            self.ids += new_ids
        if self.forward is not None:
            self.forward(b, new_ids)

    def report(self, reason):
        now = time.perf_counter()
        first = self.first_at or now
        return Report(self.ids, self.accepts, len(self.accepts), first - self.start, now - first, reason, ())


class Report:
    """What a run made for sequence 0 (all of it, or up to an interruption) and how fast."""

    def __init__(self, ids, accepts, steps, prefill_s, decode_s, reason, budgets):
        self.ids, self.accepts, self.steps, self.reason = list(ids), list(accepts), steps, reason
        self.prefill_s, self.decode_s, self.budgets = prefill_s, decode_s, list(budgets)

    @property
    def mean_accept_length(self):
        return sum(self.accepts) / len(self.accepts) if self.accepts else 0.0

    @property
    def tokens_per_s(self):
        total = self.prefill_s + self.decode_s
        return len(self.ids) / total if total > 0 else 0.0


def print_report(report, args, tok, prompt_len, speculative, device, parallel, streamer):
    """The JSON object (--json), or the end of the streamed text and the stats line."""
    if args.json:
        write_out(json.dumps({
            "output_ids": report.ids, "text": decode_text(tok, report.ids), "accept_lengths": report.accepts,
            "mean_accept_length": report.mean_accept_length, "tokens_per_s": report.tokens_per_s,
            "steps": report.steps, "prompt_tokens": prompt_len, "finish_reason": report.reason,
            "prefill_s": report.prefill_s, "decode_s": report.decode_s, "budgets": report.budgets,
        }) + "\n")
        return
    streamer.finish()
    write_out(f"[{mode_label(args, speculative, report.budgets)}] {len(report.ids)} tokens in {report.steps} steps, "
              f"mean accept length {report.mean_accept_length:.2f}, {report.tokens_per_s:.1f} tok/s "
              f"(prefill {report.prefill_s * 1e3:.0f} ms of {prompt_len} tokens, {report.reason}) on {device.type}" +
              (f" x {parallel.tp_size} ranks" if parallel.joined else "") + "\n")


def mode_label(args, speculative, budgets):
    if not speculative:
        return "target only"
    if args.tree == "chain":
        return "DFlash chain"
    if args.tree_budget != "auto":
        return f"DDTree budget {args.tree_budget}"
    chosen = sorted(Counter(budgets).items())
    return "DDTree auto" + (" (budget " + ", ".join(f"{b} x{n}" for b, n in chosen) + ")" if chosen else "")


def run(args):
    device, parallel = join_ranks(args.device, args.collective_timeout)
    finished = False
    try:
        generate(args, device, parallel)
        finished = True
    finally:
        if parallel.joined:
            # The model and engine hold the group (through Parallel) in reference cycles. A group still alive at
            # interpreter exit is destroyed there, with its gloo threads running: the likely cause of one rank's
            # abort seen once in CI ("terminate called without an active exception"). Free the cycles first.
            gc.collect()
            if finished:
                parallel.barrier()  # no rank tears the group down while another still talks to it
            dist.destroy_process_group()


def generate(args, device, parallel):
    choose_kernels(args.kernels, device)
    target, drafter, tok = load(args, device, parallel)
    try:
        latency = LatencyTable.load(args.latency_table) if args.latency_table else None
        engine = Engine(target, drafter, args.tree_budget, cuda_graphs=args.cuda_graphs, tree=args.tree,
                        latency=latency)
    except ValueError as err:
        raise UsageError(f"--latency-table: {err}") from None
    try:
        ids = engine.check_prompts([prompt_ids(args, tok)])[0]
    except (TypeError, ValueError) as err:
        raise UsageError(str(err)) from None
    sampling = SamplingParams(args.temperature, args.top_p, 0, args.seed)
    main_rank, speculative = parallel.rank == 0, drafter is not None
    streamer = None if args.json or not main_rank else Streamer(tok)
    progress = Progress(streamer)
    try:
        result = engine.generate([ids], args.max_new_tokens, sampling, stop_ids=tok.stop_ids, spec=speculative,
                                 on_tokens=progress)
    except KeyboardInterrupt:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C does not cut the report short
        try:
            if main_rank:
                print_report(progress.report("interrupted"), args, tok, len(ids), speculative, device, parallel,
                             streamer)
        finally:
            signal.signal(signal.SIGINT, previous)
        raise
    if main_rank:
        report = Report(result.output_ids[0], result.accept_lengths[0], result.steps, result.prefill_s,
                        result.decode_s, result.finish_reasons[0], result.budgets)
        print_report(report, args, tok, len(ids), speculative, device, parallel, streamer)


def out_of_memory(err):
    """One line with the sizes from an allocator's out-of-memory error (CUDA's, or the CPU allocator's)."""
    text = " ".join(str(err).split())
    tried = re.search(r"tried to allocate (\d+) bytes", text)
    if tried:
        return f"out of memory: tried to allocate {size_text(int(tried[1]))} on the CPU"
    return "out of memory: " + text.split(" Including non-PyTorch memory")[0].split(" Of the allocated")[0]


def fail(message, code):
    """Print `error: message` as one line (newlines and control characters in it, say from a file name, escaped)
    and return the exit code."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(message))
    print(f"error: {text}", file=sys.stderr)
    return code


def command_main(run, parse_args, argv=None):
    """`run(parse_args(argv))` with the commands' exit codes: 2 for bad input, 1 for a runtime failure (out of
    memory, with the sizes; a lost rank), 0 when done; one `error: ...` line, no traceback."""
    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except UsageError as err:
        return fail(err, 2)
    except (CollectiveError, OutOfMemory) as err:
        return fail(err, 1)
    except (torch.OutOfMemoryError, MemoryError) as err:
        return fail(out_of_memory(err), 1)
    except RuntimeError as err:
        if "can't allocate memory" not in str(err):
            raise
        return fail(out_of_memory(err), 1)
    return 0


def main(argv=None):
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(errors="replace")  # text in any locale, never an encoding traceback
    try:
        return command_main(run, parse_args, argv)
    except KeyboardInterrupt:
        return 130
    except StdoutClosed:
        silence_stdout()
        return 1
    except OutputError as err:
        silence_stdout()
        return fail(err, 1)
    except NonFiniteLogits as err:
        return fail(err, 1)


if __name__ == "__main__":
    sys.exit(main())
