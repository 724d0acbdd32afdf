"""The serving loop: one engine thread runs a `SlotBatch`; HTTP handlers talk to it through thread-safe queues.

A handler `submit`s a `Request` (a bounded waiting queue: `QueueFull` when it holds `max_queue`); the engine
thread, at every step boundary, makes a `Plan` (slots to release: finished by a stop string or cancelled by a
client that went away; waiting requests to admit into free slots, first come first served; whether to step)
and runs it. Each request's text comes back as `Delta`s through its own `send` callable (the handler's event
loop, called from the engine thread).

Under tensor parallelism rank 0 serves: it broadcasts every plan over a CPU (gloo) group before running it,
and every other rank runs the same plan in `follow` (same admissions into the same slots, same steps), so the
ranks' collectives line up. While idle, rank 0 sends an empty plan every HEARTBEAT_S seconds so the other
ranks never sit in one collective long enough to time out.
"""

import codecs
import logging
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from model.model import cuda_index
from spec.engine import SamplingParams

HEARTBEAT_S = 1.0
RATE_WINDOW_S = 10.0  # the window of the tokens/s and accept length gauges

log = logging.getLogger("spec.serve")


class QueueFull(Exception):
    pass


@dataclass
class Delta:
    """What a request's handler receives: new text, and at the end a finish reason and usage (or an error)."""

    text: str = ""
    finish_reason: str | None = None  # "stop" or "length"
    usage: dict | None = None
    error: str | None = None


@dataclass
class Plan:
    """One step boundary's work, identical on every rank."""

    releases: list = field(default_factory=list)  # slots
    admits: list = field(default_factory=list)  # (prompt ids, max_new, SamplingParams, stop ids)
    step: bool = False
    shutdown: bool = False


def token_bytes(tok, i):
    """The bytes token i spells (a special token its name), or None for an id the tokenizer cannot spell."""
    if i in tok.special_names:
        return tok.special_names[i].encode()
    try:
        return tok.token_bytes(i)
    except ValueError:
        return None


class TextStream:
    """Token ids in, releasable text out, spelled as the tokenizer's `decode` spells the whole output (UTF-8 with
    replacement characters; special tokens by name), with an id it cannot spell (a random tiny model emits any
    id) as <id>; decoded incrementally, so a character split over tokens waits for its last byte. Text that
    may be the start of a stop string is held back until it is known not to be one; at a stop string the text
    before it is released and `stopped` set."""

    def __init__(self, tok, stop_strings=()):
        self.tok, self.stops = tok, tuple(stop_strings)
        self.utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.held = ""
        self.stopped = False

    def push(self, ids, final=False):
        """Text released by these new ids (all of what is held when final)."""
        for i in ids:
            piece = token_bytes(self.tok, i)
            if piece is None:
                self.held += self.utf8.decode(b"", final=True) + f"<{i}>"
            else:
                self.held += self.utf8.decode(piece)
        if final:
            self.held += self.utf8.decode(b"", final=True)
        hits = [i for i in (self.held.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.held, self.stopped = self.held[: min(hits)], "", True
            return out
        keep = 0 if final else self.pending_stop()
        out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        return out

    def pending_stop(self):
        """The length of the longest tail of the held text that begins some stop string."""
        for n in range(min(len(self.held), max((len(s) for s in self.stops), default=1) - 1), 0, -1):
            tail = self.held[-n:]
            if any(s.startswith(tail) for s in self.stops):
                return n
        return 0


@dataclass
class Request:
    """One API request as the engine thread sees it. `send(Delta)` must be callable from any thread."""

    id: str
    prompt: list
    max_new: int
    sampling: SamplingParams
    stop: tuple
    send: object
    arrival: float = field(default_factory=time.perf_counter)
    cancelled: bool = False  # set by the handler when its client went away
    stream: TextStream | None = None
    output_tokens: int = 0
    accept_lengths: list = field(default_factory=list)
    first_token_at: float | None = None


class Metrics:
    """Counters since start and a sliding window for the rate gauges (engine thread writes, any thread reads)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.finished = {}  # finish reason -> requests
        self.prompt_tokens = self.output_tokens = 0
        self.verify_steps = self.accepted_tokens = 0  # per sequence: the verify steps and tokens they committed
        self.ttft_sum, self.ttft_count = 0.0, 0
        self.window = deque()  # (time, tokens emitted, verify steps, tokens committed)

    def tokens(self, n, verify_steps=0, accepted=0):
        with self.lock:
            now = time.perf_counter()
            self.output_tokens += n
            self.verify_steps += verify_steps
            self.accepted_tokens += accepted
            self.window.append((now, n, verify_steps, accepted))
            while self.window and self.window[0][0] < now - RATE_WINDOW_S:
                self.window.popleft()

    def request_done(self, reason, prompt_tokens, ttft):
        with self.lock:
            self.finished[reason] = self.finished.get(reason, 0) + 1
            self.prompt_tokens += prompt_tokens
            if ttft is not None:
                self.ttft_sum += ttft
                self.ttft_count += 1

    def rates(self):
        """(tokens/s, mean accept length) over the last RATE_WINDOW_S seconds."""
        with self.lock:
            now = time.perf_counter()
            recent = [w for w in self.window if w[0] >= now - RATE_WINDOW_S]
            tokens = sum(w[1] for w in recent)
            steps, accepted = sum(w[2] for w in recent), sum(w[3] for w in recent)
            return tokens / RATE_WINDOW_S, accepted / steps if steps else 0.0


class Control:
    """Plans from rank 0 to the other ranks over `group` (a gloo group: pickled objects on the CPU)."""

    def __init__(self, group):
        self.group = group

    def send(self, plan):
        dist.broadcast_object_list([plan], src=0, group=self.group)

    def receive(self):
        box = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


def run_plan(slots, plan):
    """The engine calls of one plan, the same on every rank. Returns (admitted Emitted list, stepped list)."""
    for slot in plan.releases:
        slots.release(slot)
    admitted = [slots.admit(*a) for a in plan.admits]
    return admitted, slots.step() if plan.step else []


def release_all(slots):
    for slot in slots.busy:
        slots.release(slot)


def follow(slots, control):
    """The loop of a rank other than 0: run rank 0's plans until it shuts down."""
    while True:
        plan = control.receive()
        if plan.shutdown:
            return
        try:
            run_plan(slots, plan)
        except Exception:  # rank 0 fails the same plan and tells its clients
            release_all(slots)


class Scheduler:
    """Rank 0's side: the waiting queue, the running requests by slot, the engine thread."""

    def __init__(self, slots, tok, max_queue, control=None):
        self.slots, self.tok, self.max_queue, self.control = slots, tok, max_queue, control
        self.cuda_index = cuda_index(slots.device)  # "cuda" alone: this thread's device, which the engine thread sets
        self.cond = threading.Condition()
        self.waiting = deque()
        self.running = {}  # slot -> Request
        self.to_release = []  # slots whose request ended on a stop string (the engine still holds them)
        self.stopping = False
        self.metrics = Metrics()
        self.thread = None

    # ---- any thread ----

    def submit(self, request):
        request.stream = TextStream(self.tok, request.stop)
        with self.cond:
            if self.stopping:
                raise QueueFull("the server is shutting down")
            if len(self.waiting) >= self.max_queue:
                raise QueueFull(f"the queue is full ({self.max_queue} requests waiting)")
            self.waiting.append(request)
            self.cond.notify()

    def cancel(self, request):
        with self.cond:
            request.cancelled = True
            self.cond.notify()

    def snapshot(self):
        """(waiting, running) counts."""
        with self.cond:
            return len(self.waiting), len(self.running)

    @property
    def alive(self):
        return self.thread is not None and self.thread.is_alive()

    def start(self):
        self.thread = threading.Thread(target=self.loop, name="engine", daemon=True)
        self.thread.start()

    def stop(self):
        with self.cond:
            self.stopping = True
            self.cond.notify()
        if self.thread is not None:
            self.thread.join()

    # ---- the engine thread ----

    def loop(self):
        message = "the server is shutting down"
        try:
            if self.cuda_index is not None:
                torch.cuda.set_device(self.cuda_index)  # the current device is per thread
            while True:
                plan, admitting = self.next_plan()
                if self.control is not None:
                    self.control.send(plan)
                if plan.shutdown:
                    break
                self.execute(plan, admitting)
        except BaseException as err:  # a failure outside a plan (a collective): nothing more can be served
            message = f"the engine stopped: {type(err).__name__}: {err}"
            log.error("engine thread stopped: %s", "".join(traceback.format_exception(err)).rstrip())
        finally:
            self.fail_all(message)

    def next_plan(self):
        """Wait for work (or the heartbeat), then take this boundary's releases and admissions."""
        with self.cond:
            while not self.stopping and not self.has_work():
                if not self.cond.wait(HEARTBEAT_S) and self.control is not None:
                    return Plan(), []
            if self.stopping:
                return Plan(shutdown=True), []
            plan = Plan(releases=self.to_release)
            self.to_release = []
            for slot, req in list(self.running.items()):
                if req.cancelled:
                    plan.releases.append(slot)
                    self.end(slot, "cancelled")
            for req in [r for r in self.waiting if r.cancelled]:
                self.waiting.remove(req)
                self.log_request(req, "cancelled")
                self.metrics.request_done("cancelled", len(req.prompt), None)
            free = self.slots.free + sum(self.slots.seqs[slot] is not None for slot in plan.releases)
            admitting = []
            while self.waiting and len(admitting) < free:
                admitting.append(self.waiting.popleft())
            plan.admits = [(r.prompt, r.max_new, r.sampling, self.tok.stop_ids) for r in admitting]
            plan.step = bool(self.running) or bool(admitting)
            return plan, admitting

    def has_work(self):
        return bool(self.waiting or self.running or self.to_release)

    def execute(self, plan, admitting):
        try:
            admitted, stepped = run_plan(self.slots, plan)
        except Exception as err:
            log.error("step failed: %s", "".join(traceback.format_exception(err)).rstrip())
            release_all(self.slots)
            message = f"the engine failed: {type(err).__name__}: {err}"
            with self.cond:
                for req in admitting + [self.running.pop(slot) for slot in list(self.running)]:
                    self.fail(req, message)
            return
        with self.cond:
            for req, out in zip(admitting, admitted):
                self.running[out.slot] = req
            for out in admitted + stepped:
                self.deliver(out)

    def deliver(self, out):
        """Send a slot's new tokens to its request as text; end the request when it finished."""
        req = self.running.get(out.slot)
        if req is None:  # ended on a stop string at admission, released at the next boundary
            return
        now = time.perf_counter()
        if req.first_token_at is None:
            req.first_token_at = now
        req.output_tokens += len(out.tokens)
        if out.accept_length is not None:
            req.accept_lengths.append(out.accept_length)
        self.metrics.tokens(len(out.tokens), int(out.accept_length is not None), out.accept_length or 0)
        tokens = out.tokens
        if out.finish_reason == "stop" and tokens and tokens[-1] in self.tok.stop_ids:
            tokens = tokens[:-1]  # the stop token ends the text; it is not part of it
        text = req.stream.push(tokens, final=out.finish_reason is not None)
        if text and not req.cancelled:
            req.send(Delta(text))
        if req.stream.stopped and out.finish_reason is None:
            self.to_release.append(out.slot)
            self.end(out.slot, "stop")
        elif out.finish_reason is not None:
            self.end(out.slot, out.finish_reason)

    def end(self, slot, reason):
        req = self.running.pop(slot)
        prompt, output = len(req.prompt), req.output_tokens
        ttft = None if req.first_token_at is None else req.first_token_at - req.arrival
        self.metrics.request_done(reason, prompt, ttft)
        self.log_request(req, reason)
        if reason != "cancelled":
            usage = {"prompt_tokens": prompt, "completion_tokens": output, "total_tokens": prompt + output}
            req.send(Delta(finish_reason=reason, usage=usage))

    def fail(self, req, message):
        req.send(Delta(error=message))
        self.metrics.request_done("error", len(req.prompt), None)
        self.log_request(req, "error")

    def fail_all(self, message):
        with self.cond:
            self.stopping = True
            for req in [self.running.pop(slot) for slot in list(self.running)] + list(self.waiting):
                self.fail(req, message)
            self.waiting.clear()

    @staticmethod
    def log_request(req, reason):
        now = time.perf_counter()
        accept = req.accept_lengths
        mean = f"{sum(accept) / len(accept):.2f}" if accept else "-"
        if req.first_token_at is None:
            ttft = rate = "-"
        else:
            ttft = f"{req.first_token_at - req.arrival:.3f} s"
            decode_s = now - req.first_token_at
            rate = f"{(req.output_tokens - 1) / decode_s:.1f}" if req.output_tokens > 1 and decode_s > 0 else "-"
        log.info("request %s: %d prompt tokens, %d output tokens (%s), mean accept length %s, ttft %s, "
                 "%s tok/s after the first, %.3f s in all", req.id, len(req.prompt), req.output_tokens, reason,
                 mean, ttft, rate, now - req.arrival)
