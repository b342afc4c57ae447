import os
from pathlib import Path

import pytest

# the golden cases live beside the checkout (../shared/golden); DSFLASH_GOLDEN_DIR points elsewhere
GOLDEN = Path(os.environ.get("DSFLASH_GOLDEN_DIR") or Path(__file__).resolve().parents[1].parent / "shared" / "golden")
GOLDEN_CASES = sorted(p for p in GOLDEN.glob("*") if (p / "golden.safetensors").exists())


@pytest.fixture(scope="session")
def golden_cases() -> list[Path]:
    assert GOLDEN_CASES, f"no golden cases under {GOLDEN}"
    return GOLDEN_CASES


ROOT = Path(__file__).resolve().parents[1]
# a server process over `create_app` (argv: checkpoint, port, max_context, model name, prefill chunk)
SERVE_SCRIPT = """
import sys
import uvicorn
from dsflash.engine.session import Engine
from dsflash.server.app import create_app
from dsflash.tokenizer import load_tokenizer

ckpt, port, context, name, chunk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
app = create_app(Engine.load(ckpt, max_context=context), load_tokenizer(ckpt), model_name=name, chunk=chunk)
uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")
"""


def partly_right_drafter(session, prompt_len: int, plain: list[int], k: int = 4):
    """A stand-in for `Session.draft` (the tiny checkpoint's random drafter is almost never right): the
    next `k` tokens of the known plain output with one wrong token in a slot that cycles, or none."""

    def draft(anchor: int, *_) -> list[int]:
        i = session.pos - prompt_len  # the anchor is output token i
        drafts = (plain[i + 1:i + 1 + k] + [0] * k)[:k]
        wrong = i % (k + 1)
        if wrong < k:
            drafts[wrong] = (drafts[wrong] + 1) % 512
        return drafts

    return draft


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: list[str], port: int, timeout: float = 120):
    """Start a server process (a real one, over loopback) and wait for its /health; returns the process."""
    import subprocess
    import sys
    import time

    import httpx

    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.Popen([sys.executable, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    t0 = time.time()
    while True:
        if proc.poll() is not None:
            pytest.fail(f"server exited: {proc.stdout.read().decode(errors='replace')[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if time.time() - t0 > timeout:
            proc.kill()
            pytest.fail("server did not come up")
        time.sleep(0.2)


def serve_app(ckpt: Path, tmp: Path, context: int, name: str, chunk: int):
    """`create_app` over a checkpoint in a server process; returns (process, base URL)."""
    script = tmp / "serve.py"
    script.write_text(SERVE_SCRIPT)
    port = free_port()
    return start_server([str(script), str(ckpt), str(port), str(context), name, str(chunk)], port), \
        f"http://127.0.0.1:{port}"
