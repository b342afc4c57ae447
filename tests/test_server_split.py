"""`dsflash serve --box` with real processes: a box, a server, the openai client. When the box is down
past the deadline the client gets a retryable 503 (SSE: an error event, then [DONE]), never another
model's answer; once the box is back the server answers again. Killing the box is the fault."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import free_port, start_server, wait_until_serving

openai = pytest.importorskip("openai")

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 4,
        "temperature": 0, "chat_template_kwargs": {"thinking": False}}


def start_box(ckpt: Path, port: int, health_port: int) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-m", "dsflash.cli", "box", "--model", str(ckpt), "--listen",
                          f"127.0.0.1:{port}", "--health-port", str(health_port)], env=ENV, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    wait_until_serving(p)
    return p


@pytest.fixture(scope="module")
def split_server(tmp_path_factory):
    from dsflash.checkpoint.builtin import seeded_checkpoint

    ckpt = seeded_checkpoint(tmp_path_factory.mktemp("builtin"))
    box_port, port = free_port(), free_port()
    health_port = free_port()
    box = start_box(ckpt, box_port, health_port)
    server = start_server(["-m", "dsflash.cli", "serve", "--model", str(ckpt), "--port", str(port), "--box",
                           f"127.0.0.1:{box_port}", "--box-deadline", "2", "--log-level", "warning",
                           "--served-model-name", "tiny"], port)
    base = f"http://127.0.0.1:{port}"
    state = {"box": box, "health_port": health_port}
    yield base, ckpt, box_port, state
    for p in (state["box"], server):
        p.kill()
        p.wait()


def test_split_server_answers_then_503_while_box_down_then_recovers(split_server):
    base, ckpt, box_port, state = split_server
    client = openai.OpenAI(base_url=base + "/v1", api_key="x")
    extra = {"chat_template_kwargs": {"thinking": False}}
    first = client.chat.completions.create(model="tiny", messages=CHAT["messages"], max_tokens=4, temperature=0,
                                           extra_body=extra)
    # greedy, no EOS in 4 tokens: a real answer, which the recovered server must repeat below
    assert (first.choices[0].finish_reason, first.usage.completion_tokens) == ("length", 4)
    assert first.choices[0].message.content
    assert httpx.get(base + "/health").json()["box"]["connected"]

    state["box"].send_signal(signal.SIGKILL)
    state["box"].wait()
    r = httpx.post(base + "/v1/chat/completions", json=CHAT, timeout=60)
    assert r.status_code == 503 and int(r.headers["Retry-After"]) > 0
    assert r.json()["error"]["code"] == "box_unavailable"
    health = httpx.get(base + "/health")  # the box is away: not "ok"
    assert health.status_code == 503 and health.json()["status"] == "degraded"
    assert health.json()["box"]["connected"] is False
    for n in (1, 2):  # one error event for the whole stream, also with several choices
        with httpx.stream("POST", base + "/v1/chat/completions", json={**CHAT, "stream": True, "n": n},
                          timeout=60) as s:
            lines = [ln for ln in s.iter_lines() if ln.startswith("data: ")]
        assert '"error"' in lines[-2] and lines[-1] == "data: [DONE]"
        assert sum('"error"' in ln for ln in lines) == 1, lines

    state["box"] = start_box(ckpt, box_port, state["health_port"])
    again = client.chat.completions.create(model="tiny", messages=CHAT["messages"], max_tokens=4, temperature=0,
                                           extra_body=extra)
    assert again.choices[0].message.content == first.choices[0].message.content
    metrics = httpx.get(base + "/metrics").text
    assert "dsflash_box_reconnects_total" in metrics
    # finished requests close their box sessions
    box_health = httpx.get(f"http://127.0.0.1:{state['health_port']}/health").json()
    assert box_health["sessions"] == 0, box_health
