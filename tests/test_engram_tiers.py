"""Engram tables off the compute device (model/engram_tables.py): the disk tier (and the host tier's gather)
give the resident table's bits, read only the rows a chunk needs, and never load the table."""

import os

import numpy as np
import pytest
import torch

from dsflash.checkpoint.reader import Checkpoint, CheckpointError
from dsflash.engine.graphs import SegmentGraphs
from dsflash.engine.runner import Runner
from dsflash.engine.sampling import SamplingParams
from dsflash.engine.session import Engine
from dsflash.engine.spec import decode
from dsflash.kernels import cpu
from dsflash.model import engram_tables
from dsflash.model.engram_tables import DiskTable, HostTable, ResidentTable, RowCache
from dsflash.model.load import load_model
from dsflash.model.state import SequenceState
from dsflash.model.tiers import Tiers
from tests.conftest import TEXT_CASE

CASE = TEXT_CASE  # tiny-A: Engram before layers 0 and 1, 33-byte rows (De 32 + one E8M0 scale)
IDS = torch.randint(3, 500, (70,), generator=torch.Generator().manual_seed(3)).tolist()
ROW_BYTES = 33
CASE_ARGS = Checkpoint(CASE).args


def table_names(case) -> list[str]:
    ckpt = Checkpoint(case)
    return [n for n in ckpt.names() if ".engram.embed." in n]


def timeline(engine: Engine) -> list[torch.Tensor]:
    """A prefill in chunks, steps of 3 and 1 rows, a rollback inside the last step, more steps; every logit."""
    s = engine.session()
    out = [s.prefill(IDS[:45], chunk=16)]
    p = s.pos
    out.append(s.step(p, IDS[45:48]))
    s.rollback(p + 1)
    out.append(s.step(p + 1, IDS[48:49]))
    out.append(s.step(p + 2, IDS[49:55]))
    return out


@pytest.fixture(scope="module")
def resident():
    return timeline(Engine.load(CASE))


def test_disk_engram_is_bit_identical_and_never_loads_the_table(resident, monkeypatch):
    """Prefill, steps and a rollback with Engram read from disk through a cache smaller than the rows used
    (evicting on the way): the resident table's logits, bit for bit; Checkpoint.get never reads a table."""
    loaded = []
    get = Checkpoint.get
    monkeypatch.setattr(Checkpoint, "get", lambda self, name: (loaded.append(name), get(self, name))[1])
    # two tables of 4 sets of RowCache.WAYS rows each
    engine = Engine.load(CASE, tiers=Tiers(engram="disk", engram_cache=2 * 4 * RowCache.WAYS * (ROW_BYTES + 16)))
    got = timeline(engine)
    assert not set(loaded) & set(table_names(CASE))
    for a, b in zip(resident, got, strict=True):
        assert torch.equal(a, b)
    stats = engine.encoder.runner.model.tier_stats()["engram"]
    assert stats["rows_read"] > 64 and stats["cache_hits"] > 0  # 32 rows a table: it evicted
    assert stats["bytes_read"] == stats["rows_read"] * ROW_BYTES
    # DSpark decoding (verify steps rolled back inside the encoder) keeps the plain tokens
    tokens = []
    for eng, k in ((Engine.load(CASE), 0), (engine, 2)):
        s = eng.session()
        tokens.append(list(decode(s, s.prefill(IDS[:30]), 8, SamplingParams(), stop=set(), dspark=k)))
    assert tokens[0] == tokens[1]


def test_disk_reads_exactly_the_distinct_rows(monkeypatch):
    """On a cold cache the disk tier reads each distinct row a chunk needs once, at its offsets (row r at
    begin + r*De, its scale at the scale's begin + r*De/32), and nothing else; with a cache holding every
    row a second session over the same tokens reads nothing; without a cache, each chunk reads its own
    distinct rows once."""
    asked: dict[str, list[torch.Tensor]] = {}
    request = ResidentTable.request

    def spy(self, ids):
        asked.setdefault(self.name, []).append(ids.clone())
        return request(self, ids)

    monkeypatch.setattr(ResidentTable, "request", spy)
    timeline(Engine.load(CASE))
    monkeypatch.undo()
    reads: list[tuple[int, int, int]] = []
    preadv = os.preadv

    def counting(fd, buffers, offset):
        reads.append((fd, offset, sum(memoryview(b).nbytes for b in buffers)))
        return preadv(fd, buffers, offset)

    monkeypatch.setattr(engram_tables.os, "preadv", counting)
    ckpt = Checkpoint(CASE)
    cold = Engine.load(CASE, tiers=Tiers(engram="disk"))
    timeline(cold)
    model = cold.encoder.runner.model
    total = 0
    for table in (e.table for e in model.engram.values()):
        assert isinstance(table, DiskTable)
        rows = torch.unique(torch.cat([t.flatten() for t in asked[table.name]])).tolist()
        total += len(rows)
        (_, begin, _), (_, sbegin, _) = ckpt.byte_range(table.name), ckpt.byte_range(table.scale_name)
        weight = sorted(off for fd, off, n in reads if fd == table._fds[0] and n == 32)
        scale = sorted(off for fd, off, n in reads if fd == table._fds[1] and n == 1)
        assert weight == [begin + r * 32 for r in rows] and scale == [sbegin + r for r in rows]
    assert sum(n for *_, n in reads) == total * ROW_BYTES == model.tier_stats()["engram"]["bytes_read"]

    reads.clear()
    s = cold.session()
    s.prefill(IDS[:45], chunk=16)
    warm = model.tier_stats()["engram"]
    assert not reads and warm["bytes_read"] == total * ROW_BYTES and warm["cache_hits"] > 0

    uncached = Engine.load(CASE, tiers=Tiers(engram="disk", engram_cache=0))
    timeline(uncached)
    per_chunk = sum(torch.unique(t).numel() for ts in asked.values() for t in ts)
    stats = uncached.encoder.runner.model.tier_stats()["engram"]
    assert stats["rows_read"] == stats["rows_unique"] == per_chunk > total
    assert stats["rows_requested"] == sum(t.numel() for ts in asked.values() for t in ts)


def test_graph_shaped_steps_with_disk_engram_are_bit_identical_on_cpu():
    """Steps the way a CUDA graph runs them with Engram off the device (hashed and gathered before the
    graph, the rows a static input): the eager resident forward's bits."""
    eager = load_model(CASE)
    shaped = Runner(load_model(CASE, tiers=Tiers(engram="disk")),
                    graphs=SegmentGraphs(max_rows=cpu.ROW_TILE, capture=False))
    runs = []
    run = shaped.graphs.run
    shaped.graphs.run = lambda key, fn, *inputs: (runs.append(len(inputs)), run(key, fn, *inputs))[1]
    ids = torch.tensor(IDS)
    outs = []
    for model in (eager, shaped):
        state, out = SequenceState(), []
        model.forward(state, ids[:20])
        for n in (1, 3, 8, 2):
            if n == 8:
                state.truncate(state.pos - 2, dict(enumerate(CASE_ARGS.compress_ratios)))
            step = model.forward(state, ids[state.pos:state.pos + n])
            out.append(torch.cat([step.logits, step.streams.flatten(1).float()], 1))
        outs.append(torch.cat(out))
    assert torch.equal(*outs)
    assert runs == [2 + 3 * 2] * 5  # every forward replayed: positions, ids, per Engram layer rows, scales, ids
    assert shaped.model.tier_stats()["engram"]["rows_read"] > 0


def test_host_table_gathers_the_resident_rows():
    """The host tier's gather (distinct rows into a staging table, ids remapped), run on the CPU: the rows
    of `engram_rows` over the whole table; a prefetch of the same ids is used, one of other ids is not."""
    ckpt = Checkpoint(CASE)
    name, scale_name = sorted(table_names(CASE))[:2][::-1]  # layers.0.engram.embed.weight, .scale
    table = HostTable(ckpt, name, scale_name, torch.device("cpu"))
    whole = (ckpt.get(name), ckpt.get(scale_name))
    gen = torch.Generator().manual_seed(0)
    for shape in ((64, 12), (1, 12), (8, 12)):
        ids = torch.randint(0, table.rows, shape, generator=gen)
        ids[-1] = ids[0]  # repeats
        expect = cpu.engram_rows(*whole, ids)
        assert torch.equal(cpu.engram_rows(*table.request(ids).wait()), expect)
        table.prefetch(ids)
        assert torch.equal(cpu.engram_rows(*table.request(ids).wait()), expect)
        table.prefetch(ids.flip(0))
        assert torch.equal(cpu.engram_rows(*table.request(ids).wait()), expect)
    assert table.stats.rows_unique < table.stats.rows_requested
    # on the CPU backend host memory is the device's: "host" is the resident table
    assert all(isinstance(e.table, ResidentTable) for e in load_model(CASE, "encoder", tiers=Tiers(engram="host"))
               .engram.values())


def test_row_cache_drops_each_sets_least_recently_used_row():
    ways, width = RowCache.WAYS, 2
    one_set = (width + 16) * ways  # a row, its id and its last use: the budget counts the index too

    def rows(ids):
        return np.array([[r % 256, r // 256] for r in ids], dtype=np.uint8)

    cache = RowCache(one_set, width, rows=1000)
    first = np.arange(10, 10 + ways)
    cache.insert(first, rows(first))
    held, got = cache.find(np.array([11, 99, 10]))
    assert held.tolist() == [True, False, True] and got.tolist() == rows([11, 10]).tolist()
    cache.insert(np.array([99]), rows([99]))  # the set is full: 12 (inserted, never used since) goes
    held, got = cache.find(np.array([*first, 99]))
    assert held.tolist() == [r != 12 for r in [*first, 99]] and got.tolist() == rows([*first[first != 12], 99]).tolist()

    two = RowCache(2 * one_set, width, rows=1000)  # row r in set r % 2
    evens = np.arange(0, 2 * (ways + 1), 2)
    two.insert(evens, rows(evens))  # one more than a set holds: the last one is not kept
    held, _ = two.find(np.array([*evens, 1]))
    assert held.tolist() == [True] * ways + [False, False]
    assert RowCache(one_set - 1, width, rows=1000).sets == 0 and RowCache(10 * one_set, width, rows=3).sets == 3
    empty = RowCache(0, width, rows=1000)
    empty.insert(np.array([1]), rows([1]))
    assert empty.find(np.array([1]))[0].tolist() == [False]


def test_damaged_rows_on_disk_are_refused_naming_the_tensor(tmp_path):
    """A NaN row the resident tier would refuse at load is refused when the disk tier reads it."""
    import shutil

    for f in CASE.glob("*.json"):
        shutil.copy(f, tmp_path / f.name)
    shutil.copy(CASE / "model.safetensors", tmp_path / "model.safetensors")
    ckpt = Checkpoint(tmp_path)
    name = "layers.0.engram.embed.weight"
    path, begin, _ = ckpt.byte_range(name)
    with open(path, "r+b") as f:
        f.seek(begin + 7 * 32 + 3)
        f.write(b"\x7f")  # E4M3 NaN in row 7
    table = DiskTable(ckpt, name, "layers.0.engram.embed.scale", torch.device("cpu"), 1 << 20)
    assert torch.equal(table.request(torch.tensor([1, 2])).wait().table.view(torch.uint8),
                       Checkpoint(CASE).get(name)[1:3].view(torch.uint8))
    with pytest.raises(CheckpointError, match=r"layers\.0\.engram\.embed\.weight.*row 7 holds NaN"):
        table.request(torch.tensor([3, 7])).wait()


def test_split_with_disk_engram_on_the_box_equals_one_process():
    """A box (its real socket, in this process) whose encoder reads Engram from disk: the prefill logits and
    the tokens of plain and DSpark decoding of one process with the resident table."""
    import socket
    import threading
    import time

    from dsflash.split.box import Box
    from dsflash.split.link import box_half
    from tests.conftest import free_port

    box = Box(CASE)
    # the box runs the encoder Runner it holds; `dsflash box` picks its tiers from the command line
    box.model = Runner(load_model(CASE, half="encoder", tiers=Tiers(engram="disk")))
    port = free_port()
    threading.Thread(target=box.serve, args=("127.0.0.1", port), daemon=True).start()
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.05)
    local, split = Engine.load(CASE), Engine.load(CASE, encoder=box_half(f"127.0.0.1:{port}"))
    outs = []
    for engine in (local, split):
        runs = []
        for k in (0, 2):
            s = engine.session()
            logits = s.prefill(IDS[:50], chunk=16)
            runs.append((logits, list(decode(s, logits, 8, SamplingParams(), stop=set(), dspark=k))))
        outs.append(runs)
    for (la, ta), (lb, tb) in zip(*outs, strict=True):
        assert torch.equal(la, lb) and ta == tb
    assert box.model.model.tier_stats()["engram"]["rows_read"] > 0
