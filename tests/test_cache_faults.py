"""The prefix cache on a broken disk (issue 19): damaged snapshot files, strangers in its directory, a full
filesystem. Real files throughout. The full disk is a 400 KiB tmpfs mounted for the test (that needs root);
where mounting is not allowed, the requests run in a child process whose RLIMIT_FSIZE (64 KiB, below one
snapshot) makes every snapshot write fail with EFBIG instead of ENOSPC."""

import json
import os
import subprocess
import sys

import pytest
import torch

from dsflash.engine.prefix_cache import PrefixCache
from dsflash.engine.session import Engine
from dsflash.engine.snapshot import decode
from tests.test_split import CASE, ROOT, prompt


@pytest.fixture(scope="module")
def engine():
    return Engine.load(CASE)


def flip_payload_byte(path):
    blob = bytearray(path.read_bytes())
    blob[-50] ^= 1
    path.write_bytes(bytes(blob))


def truncate_payload(path):
    path.write_bytes(path.read_bytes()[:-100])


@pytest.mark.parametrize("damage", [flip_payload_byte, truncate_payload])
def test_a_damaged_snapshot_is_deleted_when_read_and_then_written_again(engine, tmp_path, damage):
    ids = prompt(40, seed=1)
    plain = engine.session().sync(ids, chunk=16).logits
    engine.session().sync(ids, cache=PrefixCache(engine.identity, engine.numerics, disk_dir=tmp_path),
                          chunk=16)  # 16, 32 and 40
    (whole,) = tmp_path.glob("40-*.dsnap")
    damage(whole)
    # its RAM is empty: the files are all it has
    cache = PrefixCache(engine.identity, engine.numerics, disk_dir=tmp_path)
    n, _ = cache.lookup(ids)
    assert n == 32 and not whole.exists()
    synced = engine.session().sync(ids, cache=cache, chunk=16)
    assert synced.reused == 32 and torch.equal(synced.logits, plain)
    n, blob = PrefixCache(engine.identity, engine.numerics, disk_dir=tmp_path).lookup(ids)  # the prefix hits again
    assert n == 40 and decode(blob, engine.identity, engine.numerics)[1] == ids


def test_strangers_in_the_cache_directory_are_left_alone_and_stale_temporary_files_removed(engine, tmp_path):
    strangers = {"notes.dsnap": b"hello", "README": b"mine", f"7-{'z' * 40}.dsnap": b"not a key"}
    for name, data in strangers.items():
        (tmp_path / name).write_bytes(data)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = [tmp_path / f"40-{'a' * 40}.{int(dead.stdout)}.tmp", tmp_path / f"40-{'b' * 40}.tmp"]
    live = tmp_path / f"40-{'c' * 40}.{os.getpid()}.tmp"  # a writer still at work
    for f in [*stale, live]:
        f.write_bytes(b"partial")
    # every write evicts all it can
    cache = PrefixCache(engine.identity, engine.numerics, disk_dir=tmp_path, disk_bytes=1)
    assert not any(f.exists() for f in stale) and live.exists()
    ids = prompt(20, seed=2)
    engine.session().sync(ids, cache=cache, chunk=16)
    assert all((tmp_path / name).read_bytes() == data for name, data in strangers.items())
    assert cache.lookup(ids)[0] == 20  # RAM; the disk copies were evicted
    assert not list(tmp_path.glob("20-*.dsnap"))


REQUESTS = """
import json, sys
import torch
from dsflash.engine.prefix_cache import PrefixCache
from dsflash.engine.session import Engine

case, cache_dir = sys.argv[1:]
engine = Engine.load(case)
cache = PrefixCache(engine.identity, engine.numerics, disk_dir=cache_dir)
out = []
for i in range(12):
    ids = torch.randint(3, 511, (40,), generator=torch.Generator().manual_seed(i)).tolist()
    try:
        synced = engine.session().sync(ids, cache=cache, chunk=16)
        out.append(bool(torch.equal(synced.logits, engine.session().sync(ids, chunk=16).logits)))
    except Exception as e:
        out.append(f"{type(e).__name__}: {e}")
print(json.dumps(out))
"""


@pytest.fixture()
def full_disk(tmp_path):
    """(directory, preexec_fn for the child): a 400 KiB tmpfs, or a plain directory and a file-size limit."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(mnt)],
                             capture_output=True).returncode == 0
    if mounted:
        yield mnt, None
        subprocess.run(["umount", str(mnt)], check=True)
    else:
        import resource

        yield mnt, lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))


@pytest.mark.slow
def test_a_full_cache_disk_costs_no_request(full_disk, tmp_path):
    cache_dir, limit = full_disk
    script = tmp_path / "requests.py"
    script.write_text(REQUESTS)
    r = subprocess.run([sys.executable, str(script), str(CASE), str(cache_dir)], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}, preexec_fn=limit,
                       timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout) == [True] * 12, r.stdout
    assert r.stderr.count("cannot write snapshots") == 1, r.stderr[-3000:]
    assert not list(cache_dir.glob("*.tmp"))
