"""Hostile input where the process boundary matters: a closed pipe, a full disk, Ctrl-C, argv bytes and the
locale, the environment at import, and a tensor-parallel rank that dies or hangs. Each run ends within a bound,
with no traceback."""

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTHONPATH = os.pathsep.join([str(ROOT / "src"), str(ROOT)])  # this checkout's ops, model and spec
DECODE = [sys.executable, "-m", "spec.decode"]
LONG = ["--prompt", "Hi", "--max-new-tokens", "4000", "--tree-budget", "4"]  # runs for a minute unless stopped


def environment(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("SPEC_KERNELS", "WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(PYTHONPATH=PYTHONPATH, OMP_NUM_THREADS="1", **extra)
    return env


def start(args, stdout=subprocess.PIPE, **env):
    """`python -m spec.decode ARGS` on the CPU (where these behaviours are pinned), unless ARGS name a device."""
    args = args if "--device" in args else [*args, "--device", "cpu"]
    return subprocess.Popen([*DECODE, *args], stdout=stdout, stderr=subprocess.PIPE, env=environment(**env),
                            cwd=ROOT)


def read_until(proc, count, timeout=120):
    """The first `count` bytes (at least) the process writes to stdout: it is generating by then."""
    os.set_blocking(proc.stdout.fileno(), False)
    data, deadline = b"", time.monotonic() + timeout
    while len(data) < count:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()[-2000:]
        data += proc.stdout.read() or b""
        time.sleep(0.05)
    os.set_blocking(proc.stdout.fileno(), True)
    return data


def no_traceback(stderr):
    assert "Traceback" not in stderr and "Exception ignored" not in stderr, stderr[-3000:]


def one_error_line(stderr, *needles):
    no_traceback(stderr)
    lines = stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], stderr[-3000:]
    for needle in needles:
        assert needle in errors[0], errors[0]


def test_closed_pipe_ends_quietly():
    """`python -m spec.decode ... | head -c1`: the reader goes away mid-stream."""
    proc = start(LONG)
    assert proc.stdout.read(1)
    proc.stdout.close()
    assert proc.wait(timeout=60) == 1
    stderr = proc.stderr.read().decode()
    no_traceback(stderr)
    assert stderr == ""


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("mode", [[], ["--json"]], ids=["text", "json"])
def test_full_disk_is_one_error_line(mode):
    with open("/dev/full", "w") as full:
        proc = start(["--prompt", "Hi", "--max-new-tokens", "8", *mode], stdout=full)
        _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1
    one_error_line(stderr.decode(), "cannot write to stdout: No space left on device")


def test_ctrl_c_keeps_the_text_and_reports():
    """SIGINT mid-stream: exit 130 at once, the streamed text kept, then the stats line for it. (The report
    under --json is checked in process: test_hostile_inputs.py.)"""
    proc = start(LONG)
    streamed = read_until(proc, 40)
    proc.send_signal(signal.SIGINT)
    sent = time.monotonic()
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130 and time.monotonic() - sent < 20
    no_traceback(stderr.decode())
    text, stats = (streamed + stdout).decode().rstrip("\n").rsplit("\n", 1)
    assert text and stats.startswith("[DDTree budget 4] ") and stats.endswith("interrupted) on cpu"), stats
    assert 0 < int(stats.split()[3]) < 4000


def test_argv_bytes_and_an_ascii_locale():
    """A prompt that is not UTF-8 reaches the byte tokenizer as its bytes; text that an ASCII stdout cannot
    encode is replaced, not a traceback."""
    proc = subprocess.run([*DECODE, "--prompt", b"a\xff\xfeb", "--max-new-tokens", "6"], capture_output=True,
                          env=environment(PYTHONIOENCODING="ascii", LC_ALL="C"), cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    no_traceback(proc.stderr.decode())
    assert "(prefill" in proc.stdout.decode("ascii") and "of 4 tokens" in proc.stdout.decode("ascii")


def test_bad_spec_kernels_does_not_break_import():
    code = "import ops; print(len(ops.op_names()))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env=environment(SPEC_KERNELS="moe=warp,,=x"))
    assert proc.returncode == 0 and int(proc.stdout) > 0, proc.stderr[-2000:]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank(r, port, *extra, world=2):
    """One rank of a gloo group as torchrun would start it, streaming the default model's text."""
    return start([*LONG, "--device", "cpu", "--collective-timeout", "4", *extra], WORLD_SIZE=str(world),
                 RANK=str(r), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


@pytest.mark.parametrize("fault", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_a_dead_or_hung_rank_does_not_hang_the_others(fault):
    """Rank 1 is killed (its sockets close) or stopped (it never answers) mid-generation: rank 0 ends within
    the collective timeout with one line naming itself and the collective."""
    port = free_port()
    ranks = [rank(0, port), rank(1, port)]
    try:
        read_until(ranks[0], 20)
        ranks[1].send_signal(fault)
        sent = time.monotonic()
        _, stderr = ranks[0].communicate(timeout=60)
        assert ranks[0].returncode == 1 and time.monotonic() - sent < 30
        one_error_line(stderr.decode(), "tensor-parallel rank 0 of 2:", "failed, a peer rank died or stopped answering")
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()
            proc.stderr.close()


def test_a_rank_alone_gives_up_joining():
    """RANK=1 of 2 with nobody at MASTER_PORT: it stops waiting after the timeout."""
    proc = rank(1, free_port())
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 1
    one_error_line(stderr.decode(), "tensor-parallel rank 1 of 2: joining the group at 127.0.0.1:",
                   "within 4 s failed")
