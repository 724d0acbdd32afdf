"""`python -m spec.serve` against live servers on 127.0.0.1 (the embedded default pair on the CPU, also where a
GPU is present, like the references they are compared with): the official openai client streaming and not,
completions and chat, greedy text equal to the CLI's, seeded sampling unchanged by concurrent load, stop
strings across tokens, OpenAI-shaped errors, a bounded load test with disconnects and bad requests, the
queue's 503, two tensor-parallel ranks. In process: `SlotBatch` (sequences joining and leaving) against
`Engine.generate`, `TextStream` against the whole text's spelling; on a GPU, slot graphs against eager."""

import json
import os
import random
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch

from spec.batching import SlotBatch
from spec.decode import spell
from spec.default_model import load_default
from spec.engine import Engine, SamplingParams
from spec.scheduler import TextStream
from tests.conftest import requires_gpu
from tests.test_model_vs_hf import one_thread  # noqa: F401 (autouse fixture)

ROOT = Path(__file__).resolve().parents[1]
MODEL = "kimi-ddtree-default"
KEY = "sk-test-key"
CONTEXT = 512
BUDGET = 32  # the CLI's default tree budget, which the server shares


def child_env():
    """This checkout first on the path (then whatever the path held: packages installed aside)."""
    path = [str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path)), "OMP_NUM_THREADS": "1"}
    env.pop("SPEC_KERNELS", None)
    env.pop("SPEC_SERVE_API_KEY", None)
    return env


def healthy(url):
    """Whether /health answers 200 (the log may name the address a moment before the socket accepts)."""
    try:
        return httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


def start_server(log_path, *args, launcher=(sys.executable,)):
    """A `python -m spec.serve` child on a port the OS picks; returns (process, base URL) once /health answers."""
    env = child_env()
    log = open(log_path, "w")
    proc = subprocess.Popen([*launcher, "-m", "spec.serve", "--port", "0", "--device", "cpu", *args], cwd=ROOT,
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        found = re.search(r"on (http://127\.0\.0\.1:\d+)", Path(log_path).read_text())
        if found and healthy(found[1]):
            return proc, found[1]
        assert proc.poll() is None, Path(log_path).read_text()[-3000:]
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"the server did not come up: {Path(log_path).read_text()[-3000:]}")


def stop_server(proc, clean=True):
    """SIGTERM; a server alone shuts down gracefully with exit code 0 (torchrun ends its ranks by signal)."""
    proc.terminate()
    try:
        code = proc.wait(timeout=30)
        assert code == 0 or not clean, code
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "server.log"
    proc, url = start_server(log, "--max-batch", "4", "--max-queue", "64", "--context-len", str(CONTEXT),
                             "--api-key", KEY)
    yield url, proc, log
    assert proc.poll() is None, "the server died"
    stop_server(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def pair():
    target, drafter, tok = load_default()
    return Engine(target, drafter, BUDGET), tok


def expected(pair, prompt_ids, max_new, sampling=None):
    """(text, finish reason, output tokens) of Engine.generate for one prompt, as the server should answer."""
    engine, tok = pair
    result = engine.generate([prompt_ids], max_new, sampling, stop_ids=tok.stop_ids)
    return spelled(tok, result.output_ids[0], result.finish_reasons[0])


def spelled(tok, ids, reason):
    """(text, finish reason, output tokens) the server answers for output ids (a final stop token not shown)."""
    return spell(tok, ids[:-1] if reason == "stop" else ids), reason, len(ids)


def cli_json(*args):
    proc = subprocess.run([sys.executable, "-m", "spec.decode", "--json", "--device", "cpu", *args],
                          capture_output=True, text=True, env=child_env(), cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def cli_text(tok, cli):
    """The text the server gives for the CLI's output ids."""
    return spelled(tok, cli["output_ids"], cli["finish_reason"])[0]


def streamed(client, chat=False, **kwargs):
    """(text, finish reason, usage) of a streamed request."""
    create = client.chat.completions.create if chat else client.completions.create
    parts, finish, usage = [], None, None
    for chunk in create(model=MODEL, stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            parts.append((choice.delta.content if chat else choice.text) or "")
            finish = choice.finish_reason or finish
    return "".join(parts), finish, usage


def health(url):
    return httpx.get(url + "/health", timeout=10).json()


def wait_idle(url, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = health(url)
        if state["running"] == 0 and state["waiting"] == 0:
            return state
        time.sleep(0.1)
    raise AssertionError(f"the server did not go idle: {health(url)}")


def rss_mb(pid):
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status)[1]) / 1024


def metrics(url):
    text = httpx.get(url + "/metrics", timeout=10).text
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


# ---- in process ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", [True, False])
def test_slots_joining_and_leaving_decode_as_generate_alone(pair, spec):
    """Five sequences (greedy and sampled) join a 3-slot batch every other step and leave when done; each gets
    Engine.generate's tokens for it alone with its seed; the slots end empty."""
    engine, tok = pair
    prompts = [[257, 84, 104, 101, 32, 116], [7] * 5, list(range(40, 63)), [65, 66], [100] * 30]
    params = [SamplingParams(), SamplingParams(0.8, 0.9, 0, 11), SamplingParams(), SamplingParams(1.0, 1.0, 0, 3),
              SamplingParams(0.5, 1.0, 0, 9)]
    news = [40, 30, 25, 50, 20]
    want = [engine.generate([p], n, s, stop_ids=tok.stop_ids, spec=spec).output_ids[0]
            for p, n, s in zip(prompts, news, params)]
    slots = SlotBatch(engine, 3, 128, spec)
    got, owner, waiting, boundary = {}, {}, list(range(5)), 0
    while waiting or slots.busy:
        if waiting and slots.free and boundary % 2 == 0:
            i = waiting.pop(0)
            out = slots.admit(prompts[i], news[i], params[i], tok.stop_ids)
            owner[out.slot], got[i] = i, list(out.tokens)
            continue
        boundary += 1
        for out in slots.step():
            got[owner[out.slot]] += out.tokens
    assert [got[i] for i in range(5)] == want
    assert slots.cache.lens.tolist() == [0, 0, 0] and slots.cache.host_lens == [0, 0, 0]
    if spec:
        assert slots.dcache.lens.tolist() == [0, 0, 0] and slots.dcache.host_lens == [0, 0, 0]


def test_text_stream_spells_the_whole_in_any_chunking(pair):
    """Random ids (bytes that break UTF-8, control bytes, specials, ids the byte tokenizer cannot spell), pushed
    in random chunks, come out as the whole is spelled."""
    tok = pair[1]
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.choice([rng.randrange(256), rng.randrange(0xC0, 0x100), rng.randrange(0x80, 0xC0),
                           rng.randrange(256, 512)]) for _ in range(rng.randrange(1, 40))]
        stream, out, i = TextStream(tok), [], 0
        while i < len(ids):
            n = rng.randrange(1, 5)
            out.append(stream.push(ids[i : i + n], final=i + n >= len(ids)))
            i += n
        assert "".join(out) == spell(tok, ids)


def test_text_stream_holds_a_partial_stop_string_back(pair):
    tok = pair[1]
    stream = TextStream(tok, ("XYZ", "Q"))
    assert stream.push(list(b"abcX")) == "abc"  # "X" may begin "XYZ"
    assert stream.push(list(b"Y")) == ""
    assert stream.push(list(b"W")) == "XYW"  # it did not
    assert stream.push(list("é".encode())[:1]) == ""  # half a character
    assert stream.push(list("é".encode())[1:] + list(b"dXYZtail")) == "éd" and stream.stopped


# ---- a live server -------------------------------------------------------------------------------------------

def test_models_health_and_metrics(server, client):
    url = server[0]
    assert [m.id for m in client.models.list()] == [MODEL]
    assert health(url) == {"status": "ok", "waiting": 0, "running": 0, "slots": 4}
    names = set(metrics(url))
    assert {"kimi_ddtree_queue_depth", "kimi_ddtree_running_sequences", "kimi_ddtree_generation_tokens_per_second",
            "kimi_ddtree_mean_accept_length"} <= names


def test_greedy_completion_equals_the_cli(server, client, pair):
    cli = cli_json("--prompt", "Hello", "--max-new-tokens", "24", "--temperature", "0")
    whole = client.completions.create(model=MODEL, prompt="Hello", max_tokens=24, temperature=0)
    assert whole.choices[0].text == cli_text(pair[1], cli)
    assert whole.choices[0].finish_reason == {"stop": "stop", "length": "length"}[cli["finish_reason"]]
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (5, len(cli["output_ids"]))
    text, finish, usage = streamed(client, prompt="Hello", max_tokens=24, temperature=0)
    assert (text, finish, usage) == (whole.choices[0].text, whole.choices[0].finish_reason, whole.usage)
    assert re.search(r"request cmpl-\w+: 5 prompt tokens, 24 output tokens \(length\), mean accept length "
                     r"[0-9.]+, ttft [0-9.]+ s, [0-9.]+ tok/s", server[2].read_text())


def test_greedy_chat_equals_the_cli(server, client, pair):
    cli = cli_json("--chat", "--prompt", "Hello", "--max-new-tokens", "16", "--temperature", "0")
    messages = [{"role": "user", "content": "Hello"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert whole.choices[0].message.content == cli_text(pair[1], cli)
    assert whole.choices[0].message.role == "assistant"
    assert streamed(client, chat=True, messages=messages, max_tokens=16, temperature=0)[0] == cli_text(pair[1], cli)
    # a system prompt and several turns, through the Kimi template
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
             {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": [{"type": "text", "text": "Go"}]}]
    want = expected(pair, pair[1].apply_chat_template(turns[:3] + [{"role": "user", "content": "Go"}]), 12)
    whole = client.chat.completions.create(model=MODEL, messages=turns, max_completion_tokens=12, temperature=0)
    assert (whole.choices[0].message.content, whole.choices[0].finish_reason, whole.usage.completion_tokens) == want


def test_seeded_sampling_is_reproducible_under_concurrent_load(server, client, pair):
    ask = dict(prompt="Sampled tree", max_tokens=30, temperature=0.9, top_p=0.95, seed=1234)
    alone = client.completions.create(model=MODEL, **ask).choices[0].text
    ids = pair[1].encode("Sampled tree", allow_special=False)
    assert alone == expected(pair, ids, 30, SamplingParams(0.9, 0.95, 0, 1234))[0]
    others = [dict(prompt=f"other {i}" * (i + 1), max_tokens=20 + 5 * i, temperature=[0, 0.7, 1.3][i % 3], seed=i)
              for i in range(6)]
    with ThreadPoolExecutor(7) as pool:
        noise = [pool.submit(client.completions.create, model=MODEL, **kw) for kw in others[:3]]
        time.sleep(0.3)  # the seeded request joins a batch already decoding
        mine = pool.submit(streamed, client, **ask)
        noise += [pool.submit(client.completions.create, model=MODEL, **kw) for kw in others[3:]]
        assert mine.result()[0] == alone
        assert all(n.result().choices[0].finish_reason in ("stop", "length") for n in noise)


def test_stop_strings_cut_the_text_across_tokens(server, client, pair):
    ask = dict(prompt="Stop here", max_tokens=40, temperature=0)
    full = client.completions.create(model=MODEL, **ask).choices[0].text
    third = len(full) // 3
    stop = full[third : third + 3]  # three characters: several byte tokens
    cut = full[: full.index(stop)]
    for text, finish, _ in (streamed(client, stop=[stop, "never in the text"], **ask),
                            streamed(client, chat=False, stop=stop, **ask)):
        assert (text, finish) == (cut, "stop")
    whole = client.completions.create(model=MODEL, stop=stop, **ask).choices[0]
    assert (whole.text, whole.finish_reason) == (cut, "stop")
    assert client.completions.create(model=MODEL, stop="never in the text", **ask).choices[0].text == full


LONG_PROMPT = "x" * (CONTEXT + 1)
BAD_REQUESTS = [  # (body or raw bytes, headers, status, error code or None, words in the message)
    (b'{"model": "kimi-ddtree-default", "prompt": "a"', None, 400, None, "not valid JSON"),
    (b"[1, 2]", None, 400, None, "JSON object"),
    (b'{"model": "kimi-ddtree-default", "prompt": "a", "temperature": NaN}', None, 400, None, "NaN"),
    (b'{"model": "kimi-ddtree-default", "prompt": "a", "temperature": 1e999}', None, 400, None, "finite"),
    ({"model": "gpt-4", "prompt": "a"}, None, 404, "model_not_found", "gpt-4"),
    ({"prompt": "a"}, None, 400, None, "model"),
    ({"model": MODEL, "prompt": LONG_PROMPT}, None, 413, "context_length_exceeded", "513 tokens"),
    ({"model": MODEL, "prompt": "abc", "max_tokens": CONTEXT}, None, 413, "context_length_exceeded", "max_tokens"),
    ({"model": MODEL, "prompt": "a"}, {"Authorization": "Bearer wrong"}, 401, "invalid_api_key", "incorrect"),
    ({"model": MODEL, "prompt": "a"}, {"Authorization": ""}, 401, "invalid_api_key", "missing"),
    ({"model": MODEL, "prompt": "a", "temperature": "1"}, None, 400, None, "temperature"),
    ({"model": MODEL, "prompt": "a", "temperature": 2.5}, None, 400, None, "temperature"),
    ({"model": MODEL, "prompt": "a", "top_p": 0}, None, 400, None, "top_p"),
    ({"model": MODEL, "prompt": "a", "max_tokens": 0}, None, 400, None, "max_tokens"),
    ({"model": MODEL, "prompt": "a", "max_tokens": True}, None, 400, None, "max_tokens"),
    ({"model": MODEL, "prompt": "a", "seed": 1.5}, None, 400, None, "seed"),
    ({"model": MODEL, "prompt": "a", "seed": -1}, None, 400, None, "seed"),
    ({"model": MODEL, "prompt": "a", "temperature": 1e-9}, None, 400, None, "temperature"),
    ({"model": MODEL, "prompt": "a", "n": 2}, None, 400, None, "n = 1"),
    ({"model": MODEL, "prompt": "a", "stream": "yes"}, None, 400, None, "stream"),
    ({"model": MODEL, "prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, None, 400, None, "at most 4"),
    ({"model": MODEL, "prompt": "a", "stop": [""]}, None, 400, None, "stop"),
    ({"model": MODEL, "prompt": "a", "frequency_penalty": 0.5}, None, 400, None, "not supported"),
    ({"model": MODEL, "prompt": "a", "best_of_all": 1}, None, 400, None, "unrecognized"),
    ({"model": MODEL, "prompt": ["a", "b"]}, None, 400, None, "one prompt"),
    ({"model": MODEL, "prompt": [1, 100000]}, None, 400, None, "vocabulary"),
    ({"model": MODEL, "prompt": ""}, None, 400, None, "empty"),
]
BAD_CHATS = [
    ({"model": MODEL, "messages": []}, 400, "non-empty"),
    ({"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}, 400, "role"),
    ({"model": MODEL, "messages": [{"role": "user", "content": 3}]}, 400, "content"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "a", "tool_calls": []}]}, 400, "tool_calls"),
    ({"model": MODEL, "messages": [{"role": "user", "content": LONG_PROMPT}]}, 413, "prompt"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "a"}], "max_tokens": 3,
      "max_completion_tokens": 4}, 400, "differ"),
]


def post(url, path, body, headers=None):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(url + path, content=raw, timeout=30,
                      headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", **(headers or {})})


def check_error(response, status, code, words):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    assert words in error["message"], error["message"]


@pytest.mark.parametrize("body, headers, status, code, words", BAD_REQUESTS)
def test_bad_completion_requests_get_openai_errors(server, body, headers, status, code, words):
    check_error(post(server[0], "/v1/completions", body, headers), status, code, words)


@pytest.mark.parametrize("body, status, words", BAD_CHATS)
def test_bad_chat_requests_get_openai_errors(server, body, status, words):
    code = "context_length_exceeded" if status == 413 else None
    check_error(post(server[0], "/v1/chat/completions", body), status, code, words)


def test_errors_reach_the_openai_client_and_paths(server, client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="a", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server[0] + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}], n=3)
    check_error(httpx.get(server[0] + "/v1/nothing"), 404, None, "Not Found")


def test_load_with_disconnects_and_bad_requests(server, client, pair):
    """32 concurrent streaming clients of mixed lengths on 4 slots, 5 of them closing mid-stream, with
    malformed JSON, an unknown model, an oversized prompt and a wrong key among them: every other request gets
    the text Engine.generate gives it alone, the slots and queue end idle, the server's memory does not grow
    and it stays up."""
    url = server[0]
    engine, tok = pair
    before, rss_before = metrics(url), rss_mb(server[1].pid)
    prompts = [f"load {i}: " + "abc" * (i % 7) for i in range(32)]
    lengths = [[3, 6, 10, 16][i % 4] for i in range(32)]
    leaving = {3, 9, 14, 22, 27}
    ids = [tok.encode(p, allow_special=False) for p in prompts]
    result = engine.generate(ids, max(lengths), stop_ids=tok.stop_ids)
    want = {}
    for i, out in enumerate(result.output_ids):
        out = out[: lengths[i]]
        want[i] = spelled(tok, out, "stop" if out[-1] in tok.stop_ids else "length")

    def complete(i):
        return streamed(client, prompt=prompts[i], max_tokens=lengths[i], temperature=0)

    def leave(i):
        stream = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=400, temperature=0,
                                           stream=True)
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                break
        stream.close()
        return "left"

    bad = [(b'{"model": ', None, 400), ({"model": "unknown", "prompt": "a"}, None, 404),
           ({"model": MODEL, "prompt": LONG_PROMPT}, None, 413), ({"model": MODEL, "prompt": "a"},
                                                                 {"Authorization": "Bearer nope"}, 401)]
    with ThreadPoolExecutor(40) as pool:
        jobs = {i: pool.submit(leave if i in leaving else complete, i) for i in range(32)}
        rejected = [pool.submit(post, url, "/v1/completions", body, headers) for body, headers, _ in bad]
        results = {i: job.result(timeout=240) for i, job in jobs.items()}
        assert [r.result().status_code for r in rejected] == [status for _, _, status in bad]
    assert all(results[i] == "left" for i in leaving)
    for i in sorted(set(results) - leaving):
        text, finish, usage = results[i]
        assert (text, finish, usage.completion_tokens) == want[i], i
        assert usage.prompt_tokens == len(ids[i])
    assert wait_idle(url) == {"status": "ok", "waiting": 0, "running": 0, "slots": 4}
    after = metrics(url)
    assert after["kimi_ddtree_queue_depth"] == 0 and after["kimi_ddtree_running_sequences"] == 0

    def ended(m, reason):
        return m.get(f'kimi_ddtree_requests_total{{finish_reason="{reason}"}}', 0)

    assert rss_mb(server[1].pid) < rss_before + 32  # caches are allocated at start: no growth past allocator slack
    assert ended(after, "cancelled") - ended(before, "cancelled") == len(leaving)
    assert sum(ended(after, r) - ended(before, r) for r in ("stop", "length")) == 32 - len(leaving)
    assert client.completions.create(model=MODEL, prompt="still up", max_tokens=4).usage.completion_tokens == 4


def test_a_full_queue_answers_503(tmp_path):
    """One slot, one place in the queue: a third request is refused while the first decodes and the second
    waits; both leave (the waiting one without ever running) and the server goes idle."""
    proc, url = start_server(tmp_path / "server.log", "--max-batch", "1", "--max-queue", "1", "--context-len", "512")
    try:
        body = {"model": MODEL, "prompt": "busy", "max_tokens": 500, "temperature": 0, "stream": True}
        with httpx.Client(base_url=url, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json=body) as first:
                lines = first.iter_lines()  # kept: dropping the iterator would close the response
                next(lines)  # the first token: it holds the slot
                with http.stream("POST", "/v1/completions", json=body) as second:
                    assert second.status_code == 200
                    deadline = time.monotonic() + 10
                    while health(url)["waiting"] != 1:
                        assert time.monotonic() < deadline
                        time.sleep(0.05)
                    check_error(post(url, "/v1/completions", {**body, "stream": False}), 503, "queue_full", "busy")
        wait_idle(url)
        assert "cancelled" in (tmp_path / "server.log").read_text()
    finally:
        stop_server(proc)


def test_torchrun_two_ranks_serve_like_one_process(tmp_path, server, client):
    """Two gloo ranks, each holding half of the model: rank 0 serves and broadcasts each step's admissions;
    two concurrent requests (greedy and seeded) get the one-process server's text."""
    from tests.conftest import free_port

    launcher = (sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                str(free_port()))
    proc, url = start_server(tmp_path / "server.log", "--max-batch", "2", "--context-len", "256",
                             launcher=launcher)
    try:
        assert "x 2 ranks" in (tmp_path / "server.log").read_text()
        ranks = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        asks = [dict(prompt="Hello", max_tokens=24, temperature=0),
                dict(prompt="Two ranks", max_tokens=20, temperature=0.8, seed=5)]
        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(lambda kw: streamed(ranks, **kw)[0], asks))
        assert got == [client.completions.create(model=MODEL, **kw).choices[0].text for kw in asks]
    finally:
        stop_server(proc, clean=False)


@requires_gpu
def test_slot_graphs_equal_eager_on_a_gpu():
    """Verify graphs per (batch, tree) bucket and drafter graphs per batch size: the tokens of the eager run."""
    target, drafter, tok = load_default(torch.bfloat16, "cuda")
    prompts = [[257, 84, 104, 101], [7] * 5, list(range(40, 63)), [65, 66], [100] * 30]
    outs = []
    for graphs in (True, False):
        slots = SlotBatch(Engine(target, drafter, BUDGET, cuda_graphs=graphs), 4, 256)
        assert bool(slots.verify_graphs) == graphs
        got, owner, waiting = {}, {}, list(range(5))
        while waiting or slots.busy:
            while waiting and slots.free:
                i = waiting.pop(0)
                out = slots.admit(prompts[i], 24 + 8 * i, SamplingParams(0.7 * (i % 2), 1.0, 0, i), tok.stop_ids)
                owner[out.slot], got[i] = i, list(out.tokens)
            for out in slots.step():
                got[owner[out.slot]] += out.tokens
        outs.append(got)
    assert outs[0] == outs[1]


@requires_gpu
def test_a_server_on_the_gpu_decodes_from_its_engine_thread(tmp_path):
    """`--device cuda` (no index): the engine thread takes the device the server was built on as its own, then
    serves a completion; /health stays 200."""
    proc, url = start_server(tmp_path / "server.log", "--device", "cuda", "--max-batch", "2", "--context-len", "256")
    try:
        gpu = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        out = gpu.completions.create(model=MODEL, prompt="Hello", max_tokens=16, temperature=0)
        assert out.usage.completion_tokens > 0 and out.choices[0].text
        assert health(url)["status"] == "ok"
    finally:
        stop_server(proc)
