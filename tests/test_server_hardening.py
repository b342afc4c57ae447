"""`dsflash serve` under hostile and unlucky clients (issue 19): bodies and queues bounded, slow requests
timed out, clients that leave noticed, malformed shapes answered 400, SIGTERM bounded. Each test drives a
real server process over loopback with raw sockets, httpx or the client packages; the faults (a client
that hangs up, a stalled upload, a SIGTERM) are injected by the test as a real client or supervisor would."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from tests.conftest import after_plan, free_port, proc_status, read_metrics, start_server

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

KEY = "k3y"
AUTH = {"Authorization": f"Bearer {KEY}"}
CONTEXT = 4096
# a generation that runs for many seconds on the tiny checkpoint unless something ends it
LONG = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0, "chat_template_kwargs": {"thinking": False}}


def serve(ckpt, *flags: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = start_server(["-m", "dsflash.cli", "serve", "--model", str(ckpt), "--port", str(port), "--log-level",
                         "warning", "--max-context", str(CONTEXT), "--threads", "1", *flags], port)
    return proc, f"http://127.0.0.1:{port}"


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(10)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from dsflash.checkpoint.builtin import seeded_checkpoint

    return seeded_checkpoint(tmp_path_factory.mktemp("hardening"))


@pytest.fixture(scope="module")
def server(ckpt):
    proc, base = serve(ckpt, "--api-key", KEY, "--max-body", "64MiB", "--request-timeout", "1.5",
                       "--max-queue", "1")
    yield base
    stop(proc)


def wait_idle(base: str, timeout: float) -> float:
    """Seconds until the engine runs nothing (fails past `timeout`)."""
    t0 = time.monotonic()
    while read_metrics(base)["dsflash_running"] or read_metrics(base)["dsflash_queue_depth"]:
        assert time.monotonic() - t0 < timeout, "generations still running"
        time.sleep(0.05)
    return time.monotonic() - t0


def leave_after(base: str, path: str, body: dict, seconds: float) -> None:
    """A non-streamed request whose client hangs up after `seconds` (its read timeout)."""
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base + path, json=body, headers=AUTH, timeout=httpx.Timeout(60, read=seconds))


def health_latency(base: str) -> float:
    t0 = time.monotonic()
    assert httpx.get(base + "/health", timeout=30).status_code == 200
    return time.monotonic() - t0


U = {"role": "user", "content": "x"}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def schema(s) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": s}}


# (path, raw JSON body, the field the 400 must name); before the fix each gave a 500 with the exception text
SHAPES = [
    ("/v1/chat/completions", '{"max_tokens":1,"messages":[{"role":"user","content":"a\\ud800"}]}',
     "messages[0].content"),
    ("/v1/completions", '{"max_tokens":1,"prompt":"\\ud800"}', "prompt"),
    ("/v1/messages", '{"max_tokens":1,"messages":[{"role":"user","content":"\\udfff"}]}', "messages[0].content"),
    ("/v1/responses", '{"max_output_tokens":1,"input":[{"role":"user","content":"\\ud800"}]}',
     "input[0].content"),
    ("/v1/chat/completions", json.dumps({"max_tokens": 1, "messages": [U], "tools": TOOLS,
                                         "tool_choice": {"type": "function", "function": ["f"]}}),
     "tool_choice.function"),
    ("/v1/chat/completions", json.dumps({"max_tokens": 1, "messages": [U], "tools": TOOLS,
                                         "tool_choice": {"type": "function", "function": "f"}}),
     "tool_choice.function"),
    ("/v1/responses", json.dumps({"max_output_tokens": 1, "input": "x", "reasoning": {"effort": {"a": 1}}}),
     "reasoning.effort"),
    ("/v1/responses", json.dumps({"max_output_tokens": 1, "input": "x", "reasoning": {"effort": ["low"]}}),
     "reasoning.effort"),
    ("/v1/responses", json.dumps({"max_output_tokens": 1, "input": [{"role": ["user"], "content": "x"}]}),
     "input[0].role"),
    ("/v1/messages", json.dumps({"max_tokens": 1, "messages": [U], "system": [{"type": "text", "text": 5}]}),
     "system[0].text"),
    ("/v1/chat/completions", json.dumps({"max_tokens": 1, "messages": [U], "response_format": schema(
        {"type": "object", "properties": {"a": {"type": 5}}})}), "response_format.schema.properties.a.type"),
    ("/v1/chat/completions", json.dumps({"max_tokens": 1, "messages": [U], "response_format": schema(
        {"type": [["object"]]})}), "response_format.schema.type"),
    ("/v1/chat/completions", json.dumps({"max_tokens": 1, "messages": [U], "response_format": schema(
        {"type": "object", "properties": {"a": {}}, "required": [["a"]]})}), "response_format.schema.required"),
]


@pytest.mark.parametrize("path, body, field", SHAPES)
def test_malformed_shapes_are_400_naming_the_field(server, path, body, field):
    r = httpx.post(server + path, content=body, headers={**AUTH, "content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message.startswith(field + ":"), message
    assert "Error" not in message and "Traceback" not in message  # no internal exception text


def test_a_body_past_the_limit_is_413_before_it_is_read(ckpt, server):
    """A 50 MB body against the default 16 MiB limit: refused from its Content-Length, at once."""
    proc, base = serve(ckpt)
    try:
        body = json.dumps({"messages": [{"role": "user", "content": "word " * 10_000_000}], "max_tokens": 1})
        t0 = time.monotonic()
        r = httpx.post(base + "/v1/chat/completions", content=body, headers={"content-type": "application/json"},
                       timeout=60)
        assert r.status_code == 413 and time.monotonic() - t0 < 5
        assert r.json()["error"]["message"] == "body: larger than the server's limit of 16 MiB (--max-body)"
        # a chunked body (no Content-Length) is cut off as the bytes pass the limit
        chunks = (b"x" * 1024 ** 2 for _ in range(40))
        r = httpx.post(base + "/v1/chat/completions", content=chunks, timeout=60)
        assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"
        assert health_latency(base) < 1
    finally:
        stop(proc)


def test_a_text_too_long_for_the_context_is_refused_untokenized_while_health_answers(server):
    """A 50 MB chat body under a 64 MiB limit: a 400 naming the context, soon, without tokenizing it
    (which took minutes and gigabytes on the event loop); /health answers meanwhile."""
    body = json.dumps({"messages": [{"role": "user", "content": "word " * 10_000_000}], "max_tokens": 1})
    out = {}

    def big():
        t0 = time.monotonic()
        out["r"] = httpx.post(server + "/v1/chat/completions", content=body,
                              headers={**AUTH, "content-type": "application/json"}, timeout=60)
        out["s"] = time.monotonic() - t0

    t = threading.Thread(target=big)
    t.start()
    latencies = []
    while t.is_alive():
        latencies.append(health_latency(server))
        time.sleep(0.05)
    t.join()
    r = out["r"]
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert f"maximum context length is {CONTEXT} tokens" in r.json()["error"]["message"]
    assert out["s"] < 20 and max(latencies) < 2, (out["s"], latencies)


def test_a_full_queue_gets_503_with_retry_after(server):
    """--max-queue 1 beside the engine's two running generations: the fourth request is refused at once,
    before its body is read."""
    ask = {"messages": [{"role": "user", "content": "Hi"}], **LONG}
    clients = [threading.Thread(target=leave_after, args=(server, "/v1/chat/completions", ask, 4))
               for _ in range(3)]
    for c in clients:
        c.start()
    deadline = time.monotonic() + 3
    while read_metrics(server)["dsflash_running"] + read_metrics(server)["dsflash_queue_depth"] < 3:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    t0 = time.monotonic()
    r = httpx.post(server + "/v1/messages", json={**ask, "max_tokens": 5}, headers=AUTH, timeout=30)
    assert r.status_code == 503 and time.monotonic() - t0 < 1
    assert r.headers["retry-after"] == "2" and r.json()["error"]["type"] == "overloaded_error"
    assert "--max-queue" in r.json()["error"]["message"]
    for c in clients:
        c.join()
    wait_idle(server, 5)
    assert httpx.post(server + "/v1/messages", json={**ask, "max_tokens": 2}, headers=AUTH,
                      timeout=30).status_code == 200


# logprobs make every token an event, so the events never pause (the old code looked for a client gone
# only in a pause of half a second)
@pytest.mark.parametrize("path, extra", [("/v1/chat/completions", {"logprobs": True}), ("/v1/messages", {}),
                                         ("/v1/responses", {"max_output_tokens": 3000})])
def test_a_non_streamed_client_that_leaves_stops_its_generation(server, path, extra):
    """The client hangs up 3 s into a 3000-token answer (its read timeout): the engine stops at once."""
    before = read_metrics(server)
    body = {"messages": [{"role": "user", "content": "Hi"}], **LONG, **extra}
    if path == "/v1/responses":
        body = {"input": "Hi", **{k: v for k, v in body.items() if k not in ("messages", "max_tokens")}}
    leave_after(server, path, body, 3.0)
    assert wait_idle(server, 2.5) < 2.5  # before: 6.6 s to the whole 3000 tokens, as the tokens' pace allowed
    after = read_metrics(server)
    assert after['dsflash_finished_total{reason="cancelled"}'] == before.get(
        'dsflash_finished_total{reason="cancelled"}', 0) + 1
    assert after["dsflash_generated_tokens_total"] - before["dsflash_generated_tokens_total"] < 1500


def test_a_client_that_leaves_during_the_prefill_stops_it_at_the_next_chunk(ckpt, tmp_path):
    """A 15,000-token prompt prefilled in chunks of 512 (tens of seconds on a CPU); the client hangs up
    after 1 s: the prefill stops at the next chunk, nothing is counted as prefilled or generated (before:
    the whole prefill ran, then the generation until the client's absence was noticed)."""
    from tests.conftest import serve_app

    proc, base = serve_app(ckpt, tmp_path, 16384, "tiny", 512)
    try:
        before = read_metrics(base)
        body = {"messages": [{"role": "user", "content": "the cat sat on the mat " * 1500}], **LONG, "max_tokens": 1000}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(base + "/v1/chat/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
        assert wait_idle(base, 10) < 10
        after = read_metrics(base)
        assert after['dsflash_finished_total{reason="cancelled"}'] == 1
        for counter in ("dsflash_prefill_tokens_total", "dsflash_generated_tokens_total"):
            assert after[counter] == before[counter], counter
    finally:
        stop(proc)


def test_slow_headers_and_a_stalled_body_are_timed_out(server):
    """--request-timeout 1.5: a client sending its headers a byte at a time, and one that stops after ten
    bytes of a hundred-byte body."""
    port = int(server.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        t0 = time.monotonic()
        closed = False
        for byte in b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n":
            try:
                s.sendall(bytes([byte]))
                s.settimeout(0.3)
                if s.recv(1) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except OSError:
                closed = True
                break
        assert closed and time.monotonic() - t0 < 5
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                  "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"messages\"".encode())
        t0 = time.monotonic()
        answer = b""
        while chunk := s.recv(4096):  # the server closes after its answer
            answer += chunk
        answer = answer.decode()
        assert answer.startswith("HTTP/1.1 408") and time.monotonic() - t0 < 5
        assert "not received within 1.5 s (--request-timeout)" in answer
    assert health_latency(server) < 1


def test_the_api_description_needs_the_key_and_the_probes_do_not(server):
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert httpx.get(server + path).status_code == 401
    assert httpx.get(server + "/openapi.json", headers=AUTH).json()["info"]["title"] == "dsflash"
    assert httpx.get(server + "/health").status_code == 200 and httpx.get(server + "/metrics").status_code == 200


def until_generated(base: str, tokens: float, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while read_metrics(base)["dsflash_generated_tokens_total"] < tokens:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def sse_lines(base: str, path: str, body: dict, into: list) -> None:
    with httpx.stream("POST", base + path, json=body, timeout=60) as r:
        assert r.status_code == 200
        into.extend(line for line in r.iter_lines() if line)


@pytest.mark.slow  # ~11 s on 2 cores (a server started, streams, then the shutdown timeout)
def test_sigterm_ends_streams_cleanly_within_the_shutdown_timeout(ckpt):
    """SIGTERM with --shutdown-timeout 1 during three long generations (a chat stream, an Anthropic stream,
    a non-streamed chat): the streams end with their finish events, the other answers with its partial
    text, and the process exits 0, all within a few seconds (before: it waited for every generation)."""
    proc, base = serve(ckpt, "--shutdown-timeout", "1")
    try:
        chat, claude, plain = [], [], {}
        ask = {"messages": [{"role": "user", "content": "Hi"}], **LONG}

        def post():
            plain["r"] = httpx.post(base + "/v1/chat/completions", json=ask, timeout=60)

        threads = [threading.Thread(target=post),  # first, so that it runs (the engine runs two at once)
                   threading.Thread(target=sse_lines, args=(base, "/v1/chat/completions", {**ask, "stream": True},
                                                             chat)),
                   threading.Thread(target=sse_lines, args=(base, "/v1/messages", {**ask, "stream": True}, claude))]
        for t, tokens in zip(threads, (10, 10, 10), strict=True):
            t.start()
            until_generated(base, read_metrics(base)["dsflash_generated_tokens_total"] + tokens)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
        took = time.monotonic() - t0
        for t in threads:
            t.join(5)
        assert took < 1 + 3 + 4, took  # the grace period, the flush bound, and the process's own exit
        assert chat[-1] == "data: [DONE]" and json.loads(chat[-2][6:])["choices"][0]["finish_reason"] == "stop"
        assert claude[-2:] == ["event: message_stop", 'data: {"type": "message_stop"}'], claude[-3:]
        assert plain["r"].status_code == 200
        answer = plain["r"].json()
        assert 0 < answer["usage"]["completion_tokens"] < 3000
    finally:
        stop(proc)


def test_serve_verify_weights_refuses_a_damaged_checkpoint_in_one_line(ckpt, tmp_path):
    """One flipped byte of an FP4 expert weight (written by the test into a copy): `serve --verify-weights`
    names the tensor and serves nothing."""
    from tests.test_weight_checks import ENV, FP4, copy, poke

    flipped = copy(ckpt, tmp_path / "flipped")
    poke(flipped, FP4, at=100)
    r = subprocess.run([sys.executable, "-m", "dsflash.cli", "serve", "--model", str(flipped), "--port",
                        str(free_port()), "--verify-weights"], capture_output=True, text=True, timeout=300, env=ENV)
    err = after_plan(r.stderr)  # the memory plan, printed first, fits
    assert r.returncode == 1 and len(err.strip().splitlines()) == 1, r.stderr
    assert f"tensor '{FP4}' is damaged" in err


@pytest.mark.slow
def test_mixed_hostile_load_gives_no_5xx_and_keeps_memory_flat(ckpt):
    """Rounds of malformed shapes, clients that leave mid-answer (streamed or not), oversized and too-long
    bodies, stalled uploads and ordinary requests, from several threads at once: no 5xx except the
    queue's 503, and the server's resident memory flat over the last five of twelve rounds."""
    proc, base = serve(ckpt, "--max-body", "4MiB", "--request-timeout", "1", "--max-queue", "4")
    port = int(base.rsplit(":", 1)[1])
    statuses: list[int] = []

    def rss() -> float:
        return int(proc_status(proc.pid)["VmRSS"].split()[0]) / 1024

    def ask(path: str, **kw) -> None:
        try:
            statuses.append(httpx.post(base + path, timeout=httpx.Timeout(60, read=kw.pop("read", 60)), **kw)
                            .status_code)
        except httpx.ReadTimeout:
            pass  # the client left

    def stream_and_leave() -> None:
        with httpx.stream("POST", base + "/v1/messages", timeout=60, json={
                "messages": [{"role": "user", "content": "Hi"}], **LONG, "stream": True}) as r:
            statuses.append(r.status_code)
            for _ in r.iter_lines():
                break

    def stall() -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 50\r\n\r\n{")
            statuses.append(int(s.recv(64).split()[1]))

    def round_() -> None:
        work = [lambda p=p, b=b: ask(p, content=b, headers={"content-type": "application/json"})
                for p, b, _ in SHAPES]
        work += [lambda: ask("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], **LONG},
                             read=1.5),
                 stream_and_leave, stall,
                 lambda: ask("/v1/chat/completions", content=b"x" * (5 * 1024 ** 2)),
                 lambda: ask("/v1/chat/completions", json={"messages": [{"role": "user",
                                                                         "content": "w " * 1_500_000}]}),
                 lambda: ask("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                           "max_tokens": 3})]
        threads = [threading.Thread(target=w) for w in work]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)

    try:
        after = []  # resident MB after each round
        for _ in range(12):
            round_()
            wait_idle(base, 30)
            after.append(rss())
        assert all(s < 500 or s == 503 for s in statuses), sorted(set(statuses))
        assert {400, 408, 413, 200} <= set(statuses)
        # a leak grows with every round; the server also rises once, by 30-60 MB, at a round that varies with
        # timing (CI once saw +176 MB over rounds 2-6) and stays there: live C heap (glibc's in-use bytes), not
        # tensors or Python objects, unmoved by malloc_trim, held by oneDNN (heaptrack: torch's CPU matmul
        # primitives; docs/rejected-ideas.md, stop 35). So one step is allowed, a slope is not
        assert after[-1] - after[6] < 80 and after[-1] - after[1] < 250, after
    finally:
        stop(proc)
