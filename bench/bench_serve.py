"""Serving benchmark: time to first token, inter-token latency (p50 / p99) and aggregate tokens/s of
`python -m spec.serve` at 1, 4 and 16 concurrent streaming clients.

    python bench/bench_serve.py [--url URL] [--concurrency 1,4,16] [--requests-per-client 4] [--max-tokens 64]
                                [--out results.json] [-- server flags, e.g. --no-spec --tree-budget 16]

Without --url it starts `python -m spec.serve --port 0 --max-batch 16` (plus the flags after `--`) and stops it
at the end. Each client sends its requests one after another (POST /v1/completions, stream, temperature 0,
distinct prompts). Per level: TTFT = request sent -> first text; ITL = the gaps between successive text
chunks (one chunk is what a step released, several tokens when the tree accepted several); TPOT = (last text
- first text) / (tokens - 1), averaged over requests; tokens/s = completion tokens / wall time of the level.
Before the timed levels, one untimed request per client at each level (first compiles and graph captures);
the report gives the seconds to a healthy server (`ready_s`) and of that warm-up. Prints one JSON object
(also written to --out) and one markdown table. Bounded: --requests-per-client per
client and --time-limit seconds in all (requests not yet sent are skipped once it passes).
"""

import argparse
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
WORDS = "tree draft verify accept token sequence block budget latent expert".split()


def start_server(flags):
    """A local server on a port the OS picks; returns (process, URL, log path)."""
    log = Path(tempfile.mkstemp(prefix="bench_serve_", suffix=".log")[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "src"),
                                                                      os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", "spec.serve", "--port", "0", "--max-batch", "16", *flags],
                            cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        return proc, wait_healthy(proc, log, time.monotonic() + 1800), log  # a real checkpoint loads for minutes
    except BaseException:  # not up, or interrupted while waiting: no server left behind
        proc.kill()
        print_log_end(log)
        raise


def print_log_end(log):
    """The server log's last lines, on stderr: where the server was when the benchmark stopped."""
    print("the server's log ends:\n" + "\n".join(log.read_text().splitlines()[-25:]), file=sys.stderr)


def wait_healthy(proc, log, deadline):
    """The URL the server's log names, once its /health answers 200 (an error where it answers 503)."""
    while time.monotonic() < deadline:
        found = re.search(r"on (http://[^:]+:\d+)", log.read_text())
        if found:
            try:
                status = httpx.get(found[1] + "/health", timeout=5).status_code
                if status == 200:
                    return found[1]
                if status == 503:  # the engine thread started before the server listened, and has stopped
                    sys.exit("error: the server's engine stopped (/health answers 503)")
            except httpx.TransportError:
                pass
        if proc.poll() is not None:
            sys.exit(f"error: the server exited with code {proc.returncode}")
        time.sleep(0.5)
    sys.exit("error: the server did not come up within 30 minutes")


def prompt(i):
    return " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(8 + i % 24))


def one_request(http, model, text, max_tokens):
    """Stream one completion; returns its timings (perf_counter seconds) and token count."""
    body = {"model": model, "prompt": text, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    sent, chunks, tokens = time.perf_counter(), [], 0
    with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(event["error"]["message"])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            if any(choice.get("text") for choice in event.get("choices", [])):
                chunks.append(time.perf_counter())
    return {"sent": sent, "chunks": chunks, "tokens": tokens}


def percentile(values, q):
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def run_level(url, headers, model, clients, per_client, max_tokens, deadline, first_prompt):
    results, errors, lock = [], [], threading.Lock()

    def client(c):
        with httpx.Client(base_url=url, timeout=600, headers=headers) as http:
            for r in range(per_client):
                if time.monotonic() > deadline:
                    return
                try:
                    out = one_request(http, model, prompt(first_prompt + c * per_client + r), max_tokens)
                except (RuntimeError, httpx.HTTPError) as err:
                    with lock:
                        errors.append(str(err))
                    continue
                with lock:
                    results.append(out)

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    timed = [r for r in results if r["chunks"]]
    ttft = [(r["chunks"][0] - r["sent"]) * 1e3 for r in timed]
    itl = [(b - a) * 1e3 for r in timed for a, b in zip(r["chunks"], r["chunks"][1:])]
    tpot = [(r["chunks"][-1] - r["chunks"][0]) * 1e3 / (r["tokens"] - 1) for r in timed if r["tokens"] > 1]
    tokens = sum(r["tokens"] for r in results)

    def ms(x):
        return None if x is None else round(x, 2)

    return {"clients": clients, "requests": len(results), "errors": len(errors), "first_errors": errors[:3],
            "completion_tokens": tokens, "wall_s": round(wall, 3), "tokens_per_s": round(tokens / wall, 2),
            "ttft_ms_p50": ms(percentile(ttft, 50)), "ttft_ms_p99": ms(percentile(ttft, 99)),
            "itl_ms_p50": ms(percentile(itl, 50)), "itl_ms_p99": ms(percentile(itl, 99)),
            "tpot_ms_mean": ms(statistics.fmean(tpot)) if tpot else None}


def markdown(report):
    lines = [f"Server healthy after {report['ready_s']} s; warm-up (untimed) {report['warmup_s']} s.", "",
             "| clients | requests | tokens | tokens/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | TPOT mean ms "
             "| errors |", "|---|---|---|---|---|---|---|---|"]
    for r in report["levels"]:
        lines.append(f"| {r['clients']} | {r['requests']} | {r['completion_tokens']} | {r['tokens_per_s']} | "
                     f"{r['ttft_ms_p50']} / {r['ttft_ms_p99']} | {r['itl_ms_p50']} / {r['itl_ms_p99']} | "
                     f"{r['tpot_ms_mean']} | {r['errors']} |")
    return "\n".join(lines)


def parse_args(argv):
    own, server_flags = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", help="a running server (default: start one here)")
    p.add_argument("--api-key", default=os.environ.get("SPEC_SERVE_API_KEY"))
    p.add_argument("--concurrency", default="1,4,16", help="client counts, comma-separated")
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--time-limit", type=float, default=600, help="seconds for all levels together")
    p.add_argument("--out", help="also write the JSON report here")
    args = p.parse_args(own)
    try:
        args.levels = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        p.error(f"--concurrency: expected comma-separated integers, got {args.concurrency!r}")
    if min(args.levels) < 1 or args.requests_per_client < 1 or args.max_tokens < 1:
        p.error("--concurrency, --requests-per-client and --max-tokens must be >= 1")
    if args.url and server_flags:
        p.error("server flags after -- apply only when this script starts the server (no --url)")
    return args, server_flags


def main(argv=None):
    args, server_flags = parse_args(sys.argv[1:] if argv is None else argv)
    proc = log = None
    url, started = args.url, time.perf_counter()
    if url is None:
        proc, url, log = start_server(server_flags)
    ready_s = time.perf_counter() - started
    print(f"server healthy after {ready_s:.1f} s", file=sys.stderr, flush=True)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        with httpx.Client(base_url=url, timeout=60, headers=headers) as http:
            model = http.get("/v1/models").json()["data"][0]["id"]
        warm = time.perf_counter()
        for clients in args.levels:  # untimed: every batch size's first compiles and captures
            run_level(url, headers, model, clients, 1, 8, math.inf, 0)
        warm_s = time.perf_counter() - warm
        print(f"warm-up done in {warm_s:.1f} s", file=sys.stderr, flush=True)
        deadline = time.monotonic() + args.time_limit
        levels, first = [], 1
        for clients in args.levels:
            levels.append(run_level(url, headers, model, clients, args.requests_per_client, args.max_tokens,
                                    deadline, first))
            first += clients * args.requests_per_client
    except BaseException:  # Ctrl-C or `timeout -s INT` included: the server's last lines say where it was
        if log is not None:
            print_log_end(log)
        raise
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    report = {"url": url if args.url else "started here", "server_flags": server_flags, "model": model,
              "max_tokens": args.max_tokens, "requests_per_client": args.requests_per_client,
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "ready_s": round(ready_s, 1),
              "warmup_s": round(warm_s, 1), "levels": levels}
    if log is not None:
        report["server"] = next((line for line in log.read_text().splitlines() if " serving " in line), "")
    text = json.dumps(report, indent=1)
    print(text)
    print(markdown(report))
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
