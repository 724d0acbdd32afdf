"""`python -m spec.serve`: an OpenAI-compatible HTTP server over DDTree speculative decoding, continuously batched.

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (Kimi's chat template; system and
multi-turn messages), streaming (server-sent events ending in `data: [DONE]`) or not, GET /health and
GET /metrics (Prometheus text). Errors come in OpenAI's form {"error": {"message", "type", "param", "code"}}:
400 bad request, 401 bad or missing key (when --api-key is set), 404 unknown model or path, 413 prompt +
max_tokens past a slot's context (or a body over 32 MiB), 503 queue full or engine down.

Up to --max-batch sequences decode together (`spec.batching.SlotBatch`), each in its own cache slot of
--context-len tokens and with its own tree; a request joins at the next step boundary and leaves when done;
up to --max-queue more wait. With no --model-path it serves the embedded default pair. Under
`torchrun --nproc-per-node N` rank 0 serves HTTP and every rank runs the same steps (`spec.scheduler`).
Bad command-line input ends with one `error: ...` line on stderr and exit code 2.
"""

import argparse
import asyncio
import gc
import hmac
import json
import logging
import math
import os
import secrets
import signal
import socket
import sys
import time
import uuid

import torch
import torch.distributed as dist
import uvicorn
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from spec.batching import SlotBatch
from spec.decode import (DEFAULT_BUDGET, Parser, UsageError, add_collective_timeout, add_kernel_configs,
                         check_model_paths, choose_kernel_configs, choose_kernels, command_main, join_ranks, load)
from spec.engine import MAX_BUDGET, SEED_LIMIT, Engine, SamplingError, SamplingParams
from spec.scheduler import Control, Plan, QueueFull, Request, Scheduler, follow, log

MAX_BODY_BYTES = 32 << 20
DEFAULT_CONTEXT_CAP = 32768  # a slot's default context: a K2.6 slot of 262144 tokens holds 18 GB of latent cache
MAX_STOP_STRINGS = 4
DISCONNECT_POLL_S = 0.5  # how often a handler waiting for tokens checks that its client is still there
COMMON_KEYS = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options", "n", "user"}
COMPLETION_KEYS = COMMON_KEYS | {"prompt"}
CHAT_KEYS = COMMON_KEYS | {"messages", "max_completion_tokens"}
# OpenAI parameters accepted only at their no-op values
NO_OP_VALUES = {"presence_penalty": (0,), "frequency_penalty": (0,), "logit_bias": ({},), "logprobs": (False, 0),
                "top_logprobs": (0,), "echo": (False,), "best_of": (1,), "suffix": ("",)}


# ---- the command line ----------------------------------------------------------------------------------------

def parse_args(argv):
    p = Parser(prog="python -m spec.serve", description=__doc__.splitlines()[0])
    p.add_argument("--model-path", help="K2.6-format target checkpoint directory (default: the embedded tiny model)")
    p.add_argument("--draft-model-path", help="DFlash drafter checkpoint directory (z-lab format)")
    p.add_argument("--served-model-name", help="the model id clients ask for (default: the model directory's name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("SPEC_SERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $SPEC_SERVE_API_KEY; none: open)")
    p.add_argument("--max-batch", type=int, default=8, help="sequences decoded together (cache slots)")
    p.add_argument("--max-queue", type=int, default=256, help="requests waiting for a slot before 503")
    p.add_argument("--context-len", type=int, default=None,
                   help=f"tokens per slot, prompt + max_tokens (default: the model's context, at most "
                        f"{DEFAULT_CONTEXT_CAP})")
    p.add_argument("--tree-budget", type=int, default=DEFAULT_BUDGET, help=f"draft tree nodes, 1..{MAX_BUDGET}")
    p.add_argument("--no-spec", action="store_true", help="target-only autoregressive decoding")
    p.add_argument("--kernels", default=None, help="op=backend,... e.g. moe=triton,attention=torch or all=triton")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda when present)")
    add_kernel_configs(p)
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="replay verify and draft passes as CUDA graphs per (batch, tree) bucket (CUDA only)")
    add_collective_timeout(p)
    args = p.parse_args(argv)
    if not 1 <= args.tree_budget <= MAX_BUDGET:
        raise UsageError(f"--tree-budget must be in 1..{MAX_BUDGET}, got {args.tree_budget}")
    for flag, value in (("--max-batch", args.max_batch), ("--max-queue", args.max_queue)):
        if value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port must be in 0..65535, got {args.port}")
    if args.context_len is not None and args.context_len < 2:
        raise UsageError(f"--context-len must be >= 2, got {args.context_len}")
    if args.api_key == "":
        raise UsageError("--api-key is empty")
    check_model_paths(args)
    choose_kernel_configs(args.kernel_configs, args.device)
    args.json = False  # spec.decode.load shows load progress unless json
    return args


# ---- request bodies ------------------------------------------------------------------------------------------

class ApiError(Exception):
    def __init__(self, status, message, param=None, code=None, kind="invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self):
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(message, param=None, code=None):
    return ApiError(400, message, param, code)


def _no_constant(name):
    raise ValueError(f"{name} is not a JSON number")


async def read_body(http_request):
    """The request's bytes, refused (413) past MAX_BODY_BYTES before more is read."""
    chunks, size = [], 0
    async for chunk in http_request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def parse_json(raw):
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as err:
        raise bad(f"the request body is not valid JSON: {err}") from None
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    return body


def check_keys(body, allowed):
    for key, value in body.items():
        if key in allowed:
            continue
        if key not in NO_OP_VALUES:
            raise bad(f"unrecognized request argument: {key}", key)
        no_op = NO_OP_VALUES[key]
        if value is not None and not any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in no_op):
            raise bad(f"{key} is not supported (only {no_op[0]!r})", key)


def is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def integer(body, name, default, lo, hi):
    v = body.get(name)
    if v is None:
        return default
    if not is_int(v) or not lo <= v <= hi:
        raise bad(f"{name} must be an integer in {lo}..{hi}, got {v!r}", name)
    return v


def number(body, name, default, lo, hi, lo_open=False):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad(f"{name} must be a finite number, got {v!r}", name)
    if v > hi or v < lo or (lo_open and v == lo):
        raise bad(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {v!r}", name)
    return float(v)


def boolean(body, name, default):
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"{name} must be true or false, got {v!r}", name)
    return v


def stop_strings(body):
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("stop must be a non-empty string or a list of them", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}", "stop")
    return tuple(stops)


def stream_flags(body):
    """(stream, include_usage)."""
    stream = boolean(body, "stream", False)
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise bad("stream_options needs stream: true", "stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise bad("stream_options must be an object with at most include_usage", "stream_options")
    return stream, boolean(options, "include_usage", False)


def sampling_params(body):
    temperature = number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)
    seed = integer(body, "seed", None, 0, SEED_LIMIT - 1)
    try:
        return SamplingParams(temperature, top_p, 0, secrets.randbits(63) if seed is None else seed)
    except SamplingError as err:  # the engine's own bounds (a temperature too small to sample, say)
        raise bad(str(err), err.field) from None


def completion_prompt(body, tok, vocab):
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one prompt
    if isinstance(p, str):
        ids = tok.encode(p, allow_special=False)
    elif isinstance(p, list) and all(is_int(t) for t in p):
        if any(not 0 <= t < vocab for t in p):
            raise bad(f"prompt has token ids outside the vocabulary of {vocab}", "prompt")
        ids = p
    else:
        raise bad("prompt must be a string or a list of token ids (one prompt per request)", "prompt")
    if not ids:
        raise bad("prompt is empty", "prompt")
    return ids


def message_text(content, where):
    """A message's content: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"{where}.content[{j}] must be a text part {{'type': 'text', 'text': ...}}", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"{where}.content must be a string or a list of text parts", "messages")


def chat_prompt(body, tok):
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list", "messages")
    turns = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object", "messages")
        extra = sorted(set(m) - {"role", "content", "name"})
        if extra:
            raise bad(f"{where}.{extra[0]} is not supported", "messages")
        role = "system" if m.get("role") == "developer" else m.get("role")
        if role not in ("system", "user", "assistant"):
            raise bad(f"{where}.role must be system, developer, user or assistant, got {m.get('role')!r}", "messages")
        content = "" if role == "assistant" and m.get("content") is None else message_text(m.get("content"), where)
        name = m.get("name")
        if name is not None and not isinstance(name, str):
            raise bad(f"{where}.name must be a string", "messages")
        turns.append({"role": role, "content": content, "name": name})
    return tok.apply_chat_template(turns)


# ---- responses -----------------------------------------------------------------------------------------------

class Shapes:
    """The JSON objects of one endpoint's responses."""

    def __init__(self, chat, rid, model):
        self.chat, self.id, self.model, self.created = chat, rid, model, int(time.time())

    def head(self, obj):
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def choice(self, text, finish, first=False):
        if not self.chat:
            return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}

    def chunk(self, text, finish=None, first=False, usage=False):
        out = {**self.head("chat.completion.chunk" if self.chat else "text_completion"),
               "choices": [self.choice(text, finish, first)]}
        if usage:
            out["usage"] = None
        return out

    def usage_chunk(self, usage):
        return {**self.head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": usage}

    def whole(self, text, finish, usage):
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish}
            return {**self.head("chat.completion"), "choices": [choice], "usage": usage}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {**self.head("text_completion"), "choices": [choice], "usage": usage}


def sse(obj):
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def next_delta(queue, http_request):
    """The next Delta for a request, or None once its client has disconnected."""
    while True:
        try:
            return await asyncio.wait_for(queue.get(), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            if await http_request.is_disconnected():
                return None


class Service:
    """What the HTTP handlers share: the scheduler, tokenizer, model id, limits and key."""

    def __init__(self, scheduler, tok, model_name, context_len, vocab, api_key=None):
        self.scheduler, self.tok, self.model_name = scheduler, tok, model_name
        self.context_len, self.vocab, self.api_key = context_len, vocab, api_key
        self.created = int(time.time())

    def check_key(self, http_request):
        if self.api_key is None:
            return
        header = http_request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise ApiError(401, "missing API key: send 'Authorization: Bearer KEY'", code="invalid_api_key")
        if not hmac.compare_digest(key.strip().encode(), self.api_key.encode()):
            raise ApiError(401, "incorrect API key", code="invalid_api_key")

    def model_card(self):
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "kimi-ddtree",
                "max_model_len": self.context_len}

    def check_model(self, body):
        model = body.get("model")
        if not isinstance(model, str):
            raise bad("model must be a string naming the model (GET /v1/models)", "model")
        if model != self.model_name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           "model", "model_not_found")

    def parse(self, raw, chat):
        """(prompt ids, max_new, SamplingParams, stop strings, stream, include_usage) of a request body."""
        body = parse_json(raw)
        check_keys(body, CHAT_KEYS if chat else COMPLETION_KEYS)
        self.check_model(body)
        if body.get("n") is not None and (not is_int(body["n"]) or body["n"] != 1):
            raise bad(f"only n = 1 is supported, got {body['n']!r}", "n")
        if body.get("user") is not None and not isinstance(body["user"], str):
            raise bad("user must be a string", "user")
        max_new = integer(body, "max_tokens", None, 1, 2**31)
        if chat:
            also = integer(body, "max_completion_tokens", None, 1, 2**31)
            if None not in (max_new, also) and max_new != also:
                raise bad("max_tokens and max_completion_tokens differ", "max_completion_tokens")
            max_new = max_new or also
        sampling, stop = sampling_params(body), stop_strings(body)
        stream, include_usage = stream_flags(body)
        ids = chat_prompt(body, self.tok) if chat else completion_prompt(body, self.tok, self.vocab)
        room = self.context_len - len(ids)
        if room < 1 or (max_new is not None and max_new > room):
            asked = "" if max_new is None else f" + max_tokens {max_new}"
            raise ApiError(413, f"the prompt has {len(ids)} tokens{asked}; a sequence holds at most "
                                f"{self.context_len} (prompt + output)", "messages" if chat else "prompt",
                           "context_length_exceeded")
        return ids, max_new or room, sampling, stop, stream, include_usage

    async def complete(self, http_request, chat):
        self.check_key(http_request)
        raw = await read_body(http_request)
        # JSON parsing and tokenizing a long prompt take a while: off the event loop
        ids, max_new, sampling, stop, stream, include_usage = await asyncio.to_thread(self.parse, raw, chat)
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()

        def send(delta):
            try:
                loop.call_soon_threadsafe(queue.put_nowait, delta)
            except RuntimeError:  # the event loop has closed: nobody is listening
                pass

        shapes = Shapes(chat, f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", self.model_name)
        req = Request(shapes.id, ids, max_new, sampling, stop, send)
        try:
            self.scheduler.submit(req)
        except QueueFull as err:
            raise ApiError(503, f"the server is busy: {err}; retry later", code="queue_full", kind="server_error")
        if stream:
            events = self.events(http_request, req, queue, shapes, include_usage)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await self.collect(http_request, req, queue, shapes)

    async def collect(self, http_request, req, queue, shapes):
        parts, done = [], False
        try:
            while True:
                delta = await next_delta(queue, http_request)
                if delta is None:
                    return JSONResponse({}, status_code=499)  # nobody reads it
                if delta.error:
                    done = True
                    raise ApiError(500, delta.error, kind="server_error")
                parts.append(delta.text)
                if delta.finish_reason:
                    done = True
                    return JSONResponse(shapes.whole("".join(parts), delta.finish_reason, delta.usage))
        finally:
            if not done:
                self.scheduler.cancel(req)

    async def events(self, http_request, req, queue, shapes, include_usage):
        done = False
        try:
            if shapes.chat:
                yield sse(shapes.chunk("", first=True, usage=include_usage))
            while True:
                delta = await next_delta(queue, http_request)
                if delta is None:
                    return
                if delta.error:
                    done = True
                    yield sse(ApiError(500, delta.error, kind="server_error").body())
                    break
                if delta.text:
                    yield sse(shapes.chunk(delta.text, usage=include_usage))
                if delta.finish_reason:
                    done = True
                    yield sse(shapes.chunk("", delta.finish_reason, usage=include_usage))
                    if include_usage:
                        yield sse(shapes.usage_chunk(delta.usage))
                    break
            yield "data: [DONE]\n\n"
        finally:
            if not done:
                self.scheduler.cancel(req)

    def metrics_text(self):
        s = self.scheduler
        waiting, running = s.snapshot()
        m = s.metrics
        rate, accept = m.rates()
        lines = []

        def metric(name, kind, help_, samples):
            lines.extend([f"# HELP kimi_ddtree_{name} {help_}", f"# TYPE kimi_ddtree_{name} {kind}"])
            for labels, value in samples:
                lines.append(f"kimi_ddtree_{name}{labels} {value}")

        metric("queue_depth", "gauge", "Requests waiting for a slot.", [("", waiting)])
        metric("running_sequences", "gauge", "Sequences decoding in a slot.", [("", running)])
        metric("slots", "gauge", "Cache slots (--max-batch).", [("", s.slots.max_batch)])
        metric("generation_tokens_per_second", "gauge", "Tokens emitted per second over the last 10 s.",
               [("", f"{rate:.3f}")])
        metric("mean_accept_length", "gauge", "Tokens committed per verify step over the last 10 s.",
               [("", f"{accept:.4f}")])
        with m.lock:
            finished = dict(m.finished)
            counters = (m.prompt_tokens, m.output_tokens, m.verify_steps, m.accepted_tokens, m.ttft_sum,
                        m.ttft_count)
        metric("requests_total", "counter", "Requests ended, by finish reason.",
               [(f'{{finish_reason="{k}"}}', v) for k, v in sorted(finished.items())])
        metric("prompt_tokens_total", "counter", "Prompt tokens of ended requests.", [("", counters[0])])
        metric("generation_tokens_total", "counter", "Tokens emitted.", [("", counters[1])])
        metric("verify_steps_total", "counter", "Verify steps, per sequence.", [("", counters[2])])
        metric("accepted_tokens_total", "counter", "Tokens committed by verify steps.", [("", counters[3])])
        lines.extend(["# HELP kimi_ddtree_time_to_first_token_seconds Arrival to first token.",
                      "# TYPE kimi_ddtree_time_to_first_token_seconds summary",
                      f"kimi_ddtree_time_to_first_token_seconds_sum {counters[4]:.6f}",
                      f"kimi_ddtree_time_to_first_token_seconds_count {counters[5]}"])
        return "\n".join(lines) + "\n"


def create_app(service):
    app = FastAPI(title="kimi-ddtree", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(http_request, err):
        log.info("%s %s refused: %d %s", http_request.method, http_request.url.path, err.status, err.message)
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(HTTPException)
    async def http_error(http_request, err):
        return await api_error(http_request, ApiError(err.status_code, str(err.detail)))

    @app.exception_handler(Exception)
    async def server_error(_, err):
        log.error("unhandled error: %s: %s", type(err).__name__, err)
        return JSONResponse(ApiError(500, "internal server error", kind="server_error").body(), status_code=500)

    @app.get("/health")
    async def health():
        if not service.scheduler.alive:
            return JSONResponse(ApiError(503, "the engine is down", kind="server_error").body(), status_code=503)
        waiting, running = service.scheduler.snapshot()
        return {"status": "ok", "waiting": waiting, "running": running, "slots": service.scheduler.slots.max_batch}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(service.metrics_text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(http_request: HttpRequest):
        service.check_key(http_request)
        return {"object": "list", "data": [service.model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str, http_request: HttpRequest):
        service.check_key(http_request)
        if model != service.model_name:
            raise ApiError(404, f"the model {model!r} does not exist", "model", "model_not_found")
        return service.model_card()

    @app.post("/v1/completions")
    async def completions(http_request: HttpRequest):
        return await service.complete(http_request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(http_request: HttpRequest):
        return await service.complete(http_request, chat=True)

    return app


# ---- the process ---------------------------------------------------------------------------------------------

def bind(host, port):
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as err:
        raise UsageError(f"--host {host} --port {port}: cannot listen there ({err.strerror or err})") from None
    return sock


def control_group(parallel):
    """The group plans travel in: the world group on gloo, a gloo group beside NCCL."""
    if not parallel.joined:
        return None
    return Control(parallel.group if dist.get_backend() == "gloo" else dist.new_group(backend="gloo"))


def start(args, device, parallel):
    choose_kernels(args.kernels, device)
    target, drafter, tok = load(args, device, parallel)
    engine = Engine(target, drafter, args.tree_budget, cuda_graphs=args.cuda_graphs)
    context = args.context_len or min(engine.context_len, DEFAULT_CONTEXT_CAP)
    if context > engine.context_len:
        raise UsageError(f"--context-len {context} exceeds the model's context of {engine.context_len}")
    try:
        slots = SlotBatch(engine, args.max_batch, context, spec=drafter is not None)
    except torch.OutOfMemoryError as err:
        print(f"error: {args.max_batch} slots of {context} tokens do not fit: {err}", file=sys.stderr)
        sys.exit(1)
    control = control_group(parallel)
    if parallel.rank != 0:
        follow(slots, control)
        return
    try:
        sock = bind(args.host, args.port)
    except UsageError:
        if control is not None:
            control.send(Plan(shutdown=True))
        raise
    name = args.served_model_name or (os.path.basename(os.path.normpath(args.model_path)) if args.model_path
                                      else "kimi-ddtree-default")
    scheduler = Scheduler(slots, tok, args.max_queue, control)
    service = Service(scheduler, tok, name, context, target.cfg.vocab_size, args.api_key)
    serve_http(service, sock, args, device, parallel)


def serve_http(service, sock, args, device, parallel):
    host, port = sock.getsockname()[:2]
    mode = "target only" if args.no_spec else f"DDTree budget {args.tree_budget}"
    graphs = "on" if service.scheduler.slots.verify_graphs else "off"
    log.info("serving %s on http://%s:%d: %s, %d slots of %d tokens, queue %d, CUDA graphs %s, %s%s",
             service.model_name, host, port, mode, args.max_batch, service.context_len, args.max_queue, graphs,
             device.type, f" x {parallel.tp_size} ranks" if parallel.joined else "")
    service.scheduler.start()
    # uvicorn shuts down gracefully on SIGINT / SIGTERM, then raises the signal again: end with exit code 0
    # (after stopping the engine thread and the other ranks) instead of dying of it.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: sys.exit(0))
    config = uvicorn.Config(create_app(service), log_level="warning", access_log=False, timeout_graceful_shutdown=5)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        service.scheduler.stop()


def run(args):
    device, parallel = join_ranks(args.device, args.collective_timeout)
    try:
        start(args, device, parallel)
    finally:
        if parallel.joined:
            gc.collect()  # free the cycles that hold the group before tearing it down (see spec.decode.run)
            dist.barrier()
            dist.destroy_process_group()


def main(argv=None):
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    return command_main(run, parse_args, argv)


if __name__ == "__main__":
    sys.exit(main())
