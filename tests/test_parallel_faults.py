"""A rank that dies or stops answering takes the group down cleanly (docs/parallel.md): rank 0 raises the
retryable RankLost (an Unavailable: the server's 503 + Retry-After), every later call too, never a hang; and a
process already in a group refuses a second. Recovery is a restart: a `dsflash box` or `dsflash serve` with
`--ep 2` and its follower killed answers the retryable error and /health 503, and once restarted gives the
uninterrupted run's logits or tokens (real processes, slow set)."""

import json
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import httpx
import pytest
import torch

from dsflash.checkpoint.make import make_with_tokenizer
from dsflash.config import PRESETS
from dsflash.engine.ranks import start_ranks
from dsflash.engine.session import Engine
from dsflash.model.parallel import Layout
from dsflash.parallel.group import RankLost, Unavailable, init_group
from dsflash.split.link import BoxUnavailable, box_half
from tests.conftest import free_port, start_server
from tests.test_split import BoxProcess


@pytest.fixture(scope="module")
def tiny_b_dir(tmp_path_factory):
    from dsflash.checkpoint.make import make_checkpoint
    from dsflash.config import PRESETS

    return make_checkpoint(PRESETS["tiny-b"], 11, tmp_path_factory.mktemp("tinyb"))


@pytest.mark.parametrize("how", ["killed", "stopped"])
def test_a_lost_rank_gives_the_retryable_error_not_a_hang(tiny_b_dir, how):
    """A follower killed (its connection closes: at once) or stopped (it never answers: the group's timeout):
    rank 0 raises RankLost, an Unavailable (the server's 503 + Retry-After), and so does every later call."""
    timeout = 4.0
    sharding = start_ranks(Layout(ep=2), tiny_b_dir, "cpu", timeout_s=timeout)
    try:
        engine = Engine.load(tiny_b_dir, max_context=4096, parallel=sharding)
        s = engine.session()
        s.prefill(list(range(3, 30)))
        follower = sharding.stop_followers.procs[0]
        os.kill(follower.pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(RankLost) as lost:
            s.step(27, [5])
        assert isinstance(lost.value, Unavailable) and lost.value.retry_after > 0
        assert time.monotonic() - t0 < timeout + 10
        with pytest.raises(RankLost, match="down"):
            engine.session().prefill([1, 2, 3])
        assert follower.wait(10) is not None  # the lost rank was taken down with the group
        with pytest.raises(RuntimeError, match="already"):
            init_group(0, 2, "cpu", timeout, "127.0.0.1", 1)
    finally:
        sharding.close()


@pytest.mark.parametrize("layout", [Layout(ep=2), Layout(tp=2)], ids=["pp2ep2", "pp2tp2"])
def test_a_lost_rank_of_the_second_stage_takes_every_stage_down(tiny_b_dir, layout):
    """Layer ranges with ranks (--pp 2 --ep 2 / --tp 2): the second stage's follower killed, the next forward
    fails there with RankLost (an Unavailable) at once, the first stage is down too (every later call raises at
    once) and its follower is stopped: no rank is left waiting on a collective."""
    ranges = [(range(0, 6), "cpu"), (range(6, 12), "cpu")]
    sharding = start_ranks(layout, tiny_b_dir, "cpu", timeout_s=4.0, ranges=ranges)
    try:
        engine = Engine.load(tiny_b_dir, max_context=4096, parallel=sharding, ranges=ranges)
        s = engine.session()
        s.prefill(list(range(3, 30)))
        first, second = sharding.stop_followers.procs
        os.kill(second.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(RankLost) as lost:
            s.step(27, [5])
        assert isinstance(lost.value, Unavailable) and time.monotonic() - t0 < 10
        assert all(st.group.lost for st in sharding.stages) and sharding.lost
        t0 = time.monotonic()
        with pytest.raises(RankLost, match="down"):
            engine.session().prefill([1, 2, 3])  # the first stage's first operation
        assert time.monotonic() - t0 < 1
        assert first.wait(10) is not None and second.wait(10) is not None
    finally:
        sharding.close()


def followers_of(proc) -> list[int]:
    """The pids of the `dsflash follow` processes a command (`proc`, rank 0) started."""
    pids = [int(p) for task in Path(f"/proc/{proc.pid}/task").iterdir()
            for p in (task / "children").read_text().split()]
    return [p for p in pids if b"follow" in Path(f"/proc/{p}/cmdline").read_bytes()]


def follower_of(proc) -> int:
    """The pid of the one `dsflash follow` process a command (`proc`, rank 0) started."""
    (pid,) = followers_of(proc)
    return pid


def health(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def greedy_steps(session, logits: torch.Tensor, n: int, fault=None) -> list[torch.Tensor]:
    """n greedy one-row steps after a prefill's logits; each step's logits. `fault(i, token)` runs before step i
    (a step it makes fail is taken again: the session keeps its committed tokens)."""
    out = []
    for i in range(n):
        token = int(logits.argmax())
        if fault is not None:
            fault(i, token)
        logits = session.step(session.pos, [token])[-1]
        out.append(logits)
    return out


@pytest.mark.slow  # a box and its follower, twice, and the engine here: 11-17 s on 2 cores
def test_a_box_whose_rank_is_lost_answers_unavailable_and_a_restart_continues_the_text(tiny_b_dir):
    """`dsflash box --ep 2` with its follower killed mid-answer: the step in flight gets BoxUnavailable at once
    (the server's 503 + Retry-After), the box's health says down; once the box is restarted (fresh ranks) the
    link re-syncs the session from its committed tokens and every later step gives the one-process logits."""
    local = Engine.load(tiny_b_dir, max_context=4096)
    ids = list(range(3, 40))
    s = local.session()
    expected = greedy_steps(s, s.prefill(ids), 8)
    box = BoxProcess(free_port(), case=tiny_b_dir, flags=("--ep", "2", "--max-context", "4096")).start()
    try:
        split = Engine.load(tiny_b_dir, max_context=4096, encoder=box_half(f"127.0.0.1:{box.port}", deadline=60))
        s = split.session()

        def fault(i: int, token: int) -> None:
            if i != 3:
                return
            os.kill(follower_of(box.proc), signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(BoxUnavailable, match="rank_unavailable") as lost:
                s.step(s.pos, [token])
            assert lost.value.retry_after > 0 and time.monotonic() - t0 < 10  # not the link's 60 s deadline
            code, body = health(f"http://127.0.0.1:{box.health_port}/health")
            assert code == 503 and body["status"] == "down" and body["ranks_lost"]
            box.restart()
            assert health(f"http://127.0.0.1:{box.health_port}/health")[0] == 200

        got = greedy_steps(s, s.prefill(ids), 8, fault)
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
        assert split.encoder.link.reconnects == 1
    finally:
        box.kill()


@pytest.mark.slow  # two servers with a follower each: 11-24 s on 2 cores
def test_a_server_whose_rank_is_lost_answers_503_and_a_restart_gives_the_same_answer(tmp_path):
    """`dsflash serve --ep 2` with its follower killed: 503 + Retry-After (code rank_unavailable), /health 503
    "down"; the restarted server (fresh ranks) answers the request with the uninterrupted run's tokens."""
    ckpt = make_with_tokenizer(PRESETS["tiny-b"], 11, tmp_path / "tinyb")
    port = free_port()
    cmd = ["-m", "dsflash.cli", "serve", "--model", str(ckpt), "--port", str(port), "--ep", "2", "--device", "cpu",
           "--max-context", "4096", "--log-level", "warning", "--served-model-name", "tiny"]
    base = f"http://127.0.0.1:{port}"
    request = {"model": "tiny", "prompt": list(range(3, 30)), "max_tokens": 6, "temperature": 0}

    def answer() -> dict:
        r = httpx.post(base + "/v1/completions", json={**request, "logprobs": 0}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]  # the text, and each token with its logprob

    server = start_server(cmd, port)
    try:
        first = answer()
        assert first["finish_reason"] == "length" and len(first["logprobs"]["tokens"]) == 6
        code, body = health(base + "/health")
        assert code == 200 and body["layout"] == {"pp": 1, "ep": 2, "tp": 1} and body["ranks_lost"] is None
        os.kill(follower_of(server), signal.SIGKILL)
        r = httpx.post(base + "/v1/completions", json=request, timeout=60)
        assert r.status_code == 503 and int(r.headers["Retry-After"]) > 0
        assert r.json()["error"]["code"] == "rank_unavailable"
        code, body = health(base + "/health")
        assert code == 503 and body["status"] == "down" and body["ranks_lost"]
        server.kill()
        server.wait()
        server = start_server(cmd, port)
        assert answer() == first
    finally:
        server.kill()
        server.wait()
