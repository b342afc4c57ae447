import importlib.util
import os
from pathlib import Path

import pytest
import torch

from dsflash.model.state import SequenceState

ROOT = Path(__file__).resolve().parents[1]

# The golden cases, read through here only (tests/golden/README.md): the text cases and DeepSeek's reference
# reader and checker `load_case.py` in tests/golden/golden (DSFLASH_GOLDEN_DIR points elsewhere), the image
# cases in tests/golden/golden-vision (DSFLASH_GOLDEN_VISION_DIR).
GOLDEN = Path(os.environ.get("DSFLASH_GOLDEN_DIR") or ROOT / "tests" / "golden" / "golden")
GOLDEN_VISION = Path(os.environ.get("DSFLASH_GOLDEN_VISION_DIR") or ROOT / "tests" / "golden" / "golden-vision")
GOLDEN_CASES = sorted(p for p in GOLDEN.glob("*") if (p / "golden.safetensors").is_file())
VISION_CASES = sorted(p for p in GOLDEN_VISION.glob("*") if (p / "golden.safetensors").is_file())
TEXT_CASE = GOLDEN / "tinyA_s0_T40"  # the public text case with every per-layer array
VISION_CASE = GOLDEN_VISION / "tinyA-vis_s5"  # the public image case with every intermediate
# the tier `dsflash check-golden` reaches on each public case on the CPU reference backend (README.md, "Golden
# status"; a case found through an override but not named here must reach PASS or FAITHFUL)
CPU_TIERS = {"tinyA_s0_T40": "FAITHFUL", "tinyA-w128_s1_T200": "PASS", "tinyA-vis_s5": "PASS"}
for _need in (GOLDEN / "load_case.py", TEXT_CASE / "golden.safetensors", VISION_CASE / "golden.safetensors"):
    if not _need.is_file():  # a missing case is a broken checkout or override, never a reason to skip
        raise FileNotFoundError(f"{_need} missing (golden cases: tests/golden/README.md)")


def _import_reference():
    spec = importlib.util.spec_from_file_location("load_case", GOLDEN / "load_case.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# the reference reader and checker (numpy only, an implementation independent of dsflash); dsflash never
# imports it
reference = _import_reference()


@pytest.fixture(scope="session")
def golden_cases() -> list[Path]:
    return GOLDEN_CASES


# a server process over `create_app` (argv: checkpoint, port, max_context, model name, prefill chunk)
SERVE_SCRIPT = """
import sys
import uvicorn
from dsflash.engine.session import Engine
from dsflash.server.app import create_app
from dsflash.tokenizer import load_tokenizer
from dsflash.checkpoint.manifest import thinks

ckpt, port, context, name, chunk = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
app = create_app(Engine.load(ckpt, max_context=context), load_tokenizer(ckpt), model_name=name, chunk=chunk,
                 thinking=thinks(ckpt))
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


def proc_status(pid: int) -> dict[str, str]:
    """A process's /proc status (Linux), each field's text by its name (Threads, VmRSS in kB, SigIgn, ...)."""
    return dict(line.split(":\t", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())


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


def interleaved_steps(model, device: str) -> torch.Tensor:
    """Two sessions taking turns at steps of 1-8 rows after prompts of 20 and 27 tokens, every fifth step
    after a rollback of 2 rows (as a rejected draft), a source's buffer growing on the way: every step's
    logits and streams, in order. For comparing a model that replays graphs (or runs their fixed shapes)
    with one that does not."""
    ids = torch.randint(3, 500, (2, 200), generator=torch.Generator().manual_seed(2)).to(device)
    sizes = [1, 1, 1, 3, 3, 3, 8, 8, 1, 5, 5, 1] * 4
    ratios = dict(enumerate(model.args.compress_ratios))
    states, out = (SequenceState(device=device), SequenceState(device=device)), []
    for state, prompt, length in zip(states, ids, (20, 27), strict=True):
        model.forward(state, prompt[:length])
    for i, n in enumerate(sizes):
        state, prompt = states[i % 2], ids[i % 2]
        if state.pos + n > prompt.numel():
            break
        if i % 5 == 4:
            state.truncate(state.pos - 2, ratios)
        step = model.forward(state, prompt[state.pos:state.pos + n])
        out.append(torch.cat([step.logits, step.streams.flatten(1).float()], 1))
    return torch.cat(out)


def wait_until_serving(proc) -> None:
    """Read a `dsflash box` process's merged output until its "serving" line (the memory plan comes first);
    fail with everything it printed when it exits instead."""
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "serving" in line:
            return
    proc.kill()
    pytest.fail("box did not start: " + "".join(seen))


def after_plan(stderr: str) -> str:
    """What a command wrote to stderr after its memory plan (engine/placement.py prints the plan first; a plan
    that fits ends in a line "fits")."""
    plan, sep, rest = stderr.partition("\nfits\n")
    assert sep and ": plan: half " in plan, stderr
    return rest


@pytest.fixture(scope="module")
def oai(server):
    """The real `openai` client on the module's `server` fixture (a base URL)."""
    import openai

    return openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def claude(server):
    """The real `anthropic` client on the module's `server` fixture."""
    import anthropic

    return anthropic.Anthropic(base_url=server, api_key="x", max_retries=0)


def read_metrics(base: str) -> dict[str, float]:
    """A server's /metrics as {series (labels included): value}."""
    import httpx

    out = {}
    for line in httpx.get(base + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def end_process(proc) -> None:
    """SIGTERM, then SIGKILL after 10 s (a server fixture's teardown)."""
    import subprocess

    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
