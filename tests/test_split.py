"""The two-machine split with real processes on loopback: a `dsflash box` subprocess serves the encoder
half, this process runs the decoder half. Killing the box (SIGKILL) is the only fake: a fault."""

import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from dsflash.engine.sampling import SamplingParams
from dsflash.engine.session import Engine
from dsflash.engine.spec import DecodeStats, decode
from dsflash.split.link import BoxRefused, BoxUnavailable, box_half
from dsflash.split.protocol import VERSION, Frame, FrameType, read_frame
from tests.conftest import TEXT_CASE, free_port, partly_right_drafter, wait_until_serving

CASE = TEXT_CASE
ROOT = Path(__file__).resolve().parents[1]


class BoxProcess:
    def __init__(self, port: int, token: str | None = None, cache_dir: Path | None = None, device: str = "cpu",
                 case: Path = CASE, flags: tuple[str, ...] = (), preexec_fn=None):
        self.port, self.token, self.cache_dir, self.device, self.case = port, token, cache_dir, device, case
        self.flags, self.preexec_fn = flags, preexec_fn  # more `dsflash box` flags; a fault set up in the child
        self.health_port = free_port()  # its own free port, not port + 1 (which another socket may hold)
        self.proc = None

    def start(self) -> "BoxProcess":
        cmd = [sys.executable, "-m", "dsflash.cli", "box", "--model", str(self.case), "--listen",
               f"127.0.0.1:{self.port}", "--device", self.device, "--health-port", str(self.health_port),
               *self.flags]
        if self.token:
            cmd += ["--token", self.token]
        if self.cache_dir:
            cmd += ["--cache-dir", str(self.cache_dir)]
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     preexec_fn=self.preexec_fn)
        wait_until_serving(self.proc)
        return self

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def restart(self) -> None:
        """SIGKILL, then a fresh box process on the same port: every session is rebuilt from tokens."""
        self.kill()
        self.start()

    def health(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/health", timeout=5) as r:
            return json.loads(r.read())


@pytest.fixture(scope="module")
def local():
    return Engine.load(CASE)


@pytest.fixture()
def box(tmp_path):
    # the tiny config's max_seq_len (128) is DeepSeek's reference cache size; the engines here allow 4096
    b = BoxProcess(free_port(), cache_dir=tmp_path / "boxcache", flags=("--max-context", "4096")).start()
    yield b
    if b.proc.poll() is None:
        b.kill()


def prompt(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 511, (n,), generator=g).tolist()


GREEDY = SamplingParams()


def greedy(session, logits, n, dspark=0, params=GREEDY):
    return list(decode(session, logits, n, params, stop=set(), dspark=dspark))


def decode_across_box_restart(box: BoxProcess, session, logits, n: int, restart_after: int,
                              dspark: int = 0) -> list[int]:
    """Greedy decoding of `n` tokens with the box restarted (SIGKILL) after token `restart_after`."""
    out = []
    for i, tok in enumerate(decode(session, logits, n, GREEDY, stop=set(), dspark=dspark)):
        out.append(tok)
        if i == restart_after:
            box.restart()
    return out


def test_split_equals_single_process(local, box):
    split = Engine.load(CASE, encoder=box_half(f"127.0.0.1:{box.port}"))
    ids = prompt(90, seed=1)  # several 16-row state chunks
    a, b = local.session(), split.session()
    la, lb = a.prefill(ids, chunk=16), b.prefill(ids, chunk=16)
    assert torch.equal(la, lb)
    assert torch.equal(a.step(a.pos, [5, 6, 7]), b.step(b.pos, [5, 6, 7]))
    for k, params in ((0, SamplingParams()), (2, SamplingParams(temperature=0.8, seed=11))):
        x, y = local.session(), split.session()
        assert greedy(x, x.prefill(ids, chunk=16), 8, k, params) == greedy(y, y.prefill(ids, chunk=16), 8, k, params)
    assert box.health()["sessions"] >= 1
    # partly accepted drafts: the box rolls back to the accepted row and the text stays the plain one
    x = local.session()
    plain = greedy(x, x.prefill(ids, chunk=16), 12)
    y = split.session()
    y.draft = partly_right_drafter(y, len(ids), plain)
    stats = DecodeStats()
    assert list(decode(y, y.prefill(ids, chunk=16), 12, GREEDY, stop=set(), dspark=4, stats=stats,
                       adaptive=False)) == plain
    assert 0 < stats.accepted < stats.drafted


@pytest.mark.slow
def test_generate_cli_split_equals_single(box, tmp_path):
    ids = tmp_path / "p.json"
    ids.write_text(json.dumps(prompt(40, seed=2)))
    cmd = [sys.executable, "-m", "dsflash.cli", "generate", "--model", str(CASE), "--prompt-tokens", str(ids),
           "-n", "6", "--dspark", "2", "--chunk", "16", "--json"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    single = json.loads(subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout)
    split = json.loads(subprocess.run(cmd + ["--box", f"127.0.0.1:{box.port}"], env=env, capture_output=True,
                                      text=True, check=True).stdout)
    assert single["tokens"] == split["tokens"]


@pytest.mark.slow
def test_box_killed_mid_answer_and_restarted_gives_the_same_text(local, box):
    ids = prompt(50, seed=3)
    ref = local.session()
    expected = greedy(ref, ref.prefill(ids), 12, dspark=2)
    split = Engine.load(CASE, encoder=box_half(f"127.0.0.1:{box.port}", deadline=60))
    s = split.session()
    assert decode_across_box_restart(box, s, s.prefill(ids), 12, restart_after=4, dspark=2) == expected
    assert split.encoder.link.reconnects >= 1


@pytest.mark.slow
def test_box_that_never_returns_gives_a_retryable_error_then_service_resumes(local, box):
    split = Engine.load(CASE, encoder=box_half(f"127.0.0.1:{box.port}", deadline=2))
    ids = prompt(20, seed=4)
    s = split.session()
    s.prefill(ids)
    box.kill()
    t0 = time.monotonic()
    with pytest.raises(BoxUnavailable):
        s.step(s.pos, [9])
    assert time.monotonic() - t0 < 10
    box.start()
    fresh = split.session()
    ref = local.session()
    assert torch.equal(fresh.prefill(ids), ref.prefill(ids))


def assert_closed(sock: socket.socket) -> None:
    """The box closed the connection (an orderly close, or a reset when our unread bytes were left)."""
    try:
        assert sock.recv(1) == b""
    except ConnectionResetError:
        pass


def raw_connect(port):
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def test_malformed_oversized_and_unauthorised_frames_are_refused(tmp_path):
    b = BoxProcess(free_port(), token="s3cret").start()
    try:
        with raw_connect(b.port) as sock:  # garbage
            sock.sendall(b"GET / HTTP/1.1\r\n\r\n" + b"x" * 100)
            f = read_frame(sock)
            assert f.type == FrameType.ERROR and f.meta["code"] == "malformed"
            assert_closed(sock)
        with raw_connect(b.port) as sock:  # a header announcing a frame over the limit
            sock.sendall(struct.pack("<4sHBBII", b"DSFL", VERSION, int(FrameType.HELLO), 0, 1, 1 << 30))
            f = read_frame(sock)
            assert f.type == FrameType.ERROR and "exceeds" in f.meta["message"]
        with raw_connect(b.port) as sock:  # wrong token
            sock.sendall(Frame(FrameType.HELLO, 1, {"token": "nope", "identity": "x", "numerics": 1}).encode())
            f = read_frame(sock)
            assert f.type == FrameType.ERROR and f.meta["code"] == "auth"
            assert_closed(sock)
        with pytest.raises(BoxRefused):
            Engine.load(CASE, encoder=box_half(f"127.0.0.1:{b.port}", token="wrong")).session().prefill([5, 6, 7])
        # the box still serves a well-behaved client
        good = Engine.load(CASE, encoder=box_half(f"127.0.0.1:{b.port}", token="s3cret"))
        local = Engine.load(CASE)
        ids = prompt(12, seed=5)
        assert torch.equal(good.session().prefill(ids), local.session().prefill(ids))
        assert b.health()["status"] == "ok"
    finally:
        b.kill()


@pytest.mark.slow
def test_two_concurrent_requests_match_running_alone(local, box):
    split = Engine.load(CASE, encoder=box_half(f"127.0.0.1:{box.port}"))
    prompts = [prompt(60, seed=6), prompt(25, seed=7)]
    alone = []
    for ids in prompts:
        s = local.session()
        alone.append(greedy(s, s.prefill(ids, chunk=16), 8, dspark=2))
    results = [None, None]

    def run(i):
        s = split.session()
        results[i] = greedy(s, s.prefill(prompts[i], chunk=16), 8, dspark=2)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == alone


@pytest.mark.slow
def test_box_killed_mid_prefill_and_restarted_gives_the_same_state(local, box):
    ids = prompt(1500, seed=8)
    split = Engine.load(CASE, encoder=box_half(f"127.0.0.1:{box.port}", deadline=60), max_context=4096)
    s = split.session()
    result = {}
    worker = threading.Thread(target=lambda: result.update(logits=s.prefill(ids, chunk=16)))
    worker.start()
    time.sleep(1.5)  # well inside the ~94 chunks of the prefill
    box.restart()
    worker.join(120)
    ref = Engine(local.decoder, local.encoder, 4096, local.identity).session()
    assert torch.equal(result["logits"], ref.prefill(ids, chunk=16))
    assert torch.equal(s.step(s.pos, [5, 6]), ref.step(ref.pos, [5, 6]))
    assert split.encoder.link.reconnects >= 1


def test_a_non_loopback_box_needs_a_token():
    r = subprocess.run([sys.executable, "-m", "dsflash.cli", "box", "--model", str(CASE), "--listen", "0.0.0.0:7999"],
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--token" in r.stderr
