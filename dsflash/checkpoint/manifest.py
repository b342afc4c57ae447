"""Weight manifests: each tensor's SHA-256, written beside the weights (`model.manifest.json`, by
`dsflash make-checkpoint`) and checked on request (`--verify-weights` of `dsflash box` and `dsflash
generate`), so a damaged byte is refused with its tensor's name instead of quietly changing the tokens.

    {"format": 1, "algorithm": "sha256", "config.json": hex, "tensors": {name: {"file": ..., "sha256": hex}}}

and, for a checkpoint `make-checkpoint` drew from a seed, `"seeded": seed`: random weights that never learnt
anything; for a trained one that never saw thinking-mode text, `"thinks": false`. The server's thinking
default is off for both (see `thinks`).

Hashing reads every byte once (in threads: hashlib and file reads release the GIL); the always-on NaN
scan of 8-bit floats at load (reader.nan_bytes) is what catches damage when no manifest is checked.
"""

from __future__ import annotations

import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from dsflash.checkpoint.reader import Checkpoint, CheckpointError

MANIFEST = "model.manifest.json"
FORMAT = 1


def _digests(ckpt: Checkpoint) -> dict[str, str]:
    names = ckpt.names()
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1)) as pool:
        return dict(zip(names, pool.map(ckpt.digest, names), strict=True))


def _config_digest(path: Path) -> str:
    return hashlib.sha256((path / "config.json").read_bytes()).hexdigest()


def write_manifest(path: str | Path, seed: int | None = None, thinks: bool = True) -> Path:
    """Hash the checkpoint at `path` as it is now into `path/model.manifest.json` (with `seed`: its weights
    were drawn from it; `thinks` False: it never learnt to reason); returns its path."""
    path = Path(path)
    ckpt = Checkpoint(path)
    tensors = {name: {"file": ckpt.file_of(name), "sha256": d} for name, d in _digests(ckpt).items()}
    out = path / MANIFEST
    manifest = {"format": FORMAT, "algorithm": "sha256", "config.json": _config_digest(path), "tensors": tensors}
    if seed is not None:
        manifest["seeded"] = seed
    if not thinks:
        manifest["thinks"] = False
    out.write_text(json.dumps(manifest, indent=1) + "\n")
    return out


def _read(path: str | Path) -> dict:
    try:
        manifest = json.loads((Path(path) / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


def thinks(path: str | Path) -> bool:
    """Whether the checkpoint at `path` may have learnt to reason: not seeded weights, nor a trained model its
    manifest says never saw thinking-mode text. The server does not make one that did not reason unless
    asked."""
    manifest = _read(path)
    return "seeded" not in manifest and manifest.get("thinks", True) is not False


def verify_weights(path: str | Path) -> int:
    """Refuse (CheckpointError, naming the tensor) a checkpoint that differs from its manifest: a changed
    config, a tensor missing, added, moved or with other bytes. Returns the number of tensors checked."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        want = {name: (e["file"], e["sha256"]) for name, e in manifest["tensors"].items()}
        config = manifest["config.json"]
    except FileNotFoundError as e:
        raise CheckpointError(f"{path}: no {MANIFEST} to verify the weights against") from e
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{path / MANIFEST}: not a weight manifest ({e!r})") from e
    if manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path / MANIFEST}: manifest format {manifest.get('format')}, this build reads {FORMAT}")
    if _config_digest(path) != config:
        raise CheckpointError(f"{path}: config.json differs from the one {MANIFEST} was made with")
    ckpt = Checkpoint(path)
    odd = sorted(set(want) ^ set(ckpt.names()))
    if odd:
        where = "is missing from the weights" if odd[0] in want else "is not in the manifest"
        raise CheckpointError(f"{path}: tensor {odd[0]!r} {where} ({MANIFEST}; {len(odd)} such tensors)")
    for name, digest in _digests(ckpt).items():
        file, expected = want[name]
        if ckpt.file_of(name) != file:
            raise CheckpointError(f"{path}: tensor {name!r} is in {ckpt.file_of(name)}, the manifest says {file}")
        if digest != expected:
            raise CheckpointError(f"{path / file}: tensor {name!r} is damaged: its bytes hash to {digest[:16]}..., "
                                  f"{MANIFEST} says {expected[:16]}...")
    return len(want)
