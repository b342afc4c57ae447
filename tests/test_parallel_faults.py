"""A rank that dies or stops answering takes the group down cleanly (docs/parallel.md): rank 0 raises the
retryable RankLost (an Unavailable: the server's 503 + Retry-After), every later call too, never a hang; and a
process already in a group refuses a second."""

import os
import signal
import time

import pytest

from dsflash.engine.ranks import start_ranks
from dsflash.engine.session import Engine
from dsflash.model.parallel import Layout
from dsflash.parallel.group import RankLost, Unavailable, init_group


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
