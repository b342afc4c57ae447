"""Build a model from a checkpoint directory: config, weights and the Engram token map."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from dsflash.checkpoint.reader import CheckpointError, open_checkpoint
from dsflash.config import ModelArgs
from dsflash.model.parallel import Sharding
from dsflash.model.tiers import RESIDENT, Tiers
from dsflash.model.transformer import Transformer


class StubVocabulary:
    """Token texts of a checkpoint that ships no tokenizer (DeepSeek's tiny test models): token 2k
    reads "w{k}" and 2k+1 " W{k}", which normalise alike, so Engram sees vocab/2 classes."""

    def __init__(self, size: int):
        self.size = size

    def __len__(self) -> int:
        return self.size

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        (i,) = ids
        return f"w{i // 2}" if i % 2 == 0 else f" W{i // 2}"

    def id_to_token(self, i: int) -> str:
        return self.decode([i])


def engram_token_map(path: Path, args: ModelArgs) -> list[int]:
    """The compressed token id of every token id (spec §8), from the checkpoint's tokenizer.json (or, when
    it ships none, the stand-in vocabulary); refused unless it gives the config's class count, since the
    Engram tables are indexed by those classes."""
    from dsflash.tokenizer import compressed_token_map, load_tokenizer

    file = path / "tokenizer.json"
    if file.exists():
        token_map, classes = compressed_token_map(load_tokenizer(path))
        source = f"the tokenizer {file}"
    else:
        token_map, classes = compressed_token_map(StubVocabulary(args.vocab_size))
        source = f"no tokenizer.json in {path}: the stand-in vocabulary of {args.vocab_size} tokens"
    if classes != args.engram_compressed_vocab_size:
        raise CheckpointError(f"{source} gives {classes} Engram token classes, but config.json "
                              f"engram_compressed_vocab_size is {args.engram_compressed_vocab_size}: the "
                              "tokenizer and the weights are of different models")
    return token_map


def load_model(path: str | Path, half: str | None = None, device: str = "cpu", reference: bool = False,
               tiers: Tiers = RESIDENT, loaded: Callable[[int], None] | None = None,
               ranges: Sequence[tuple[range, str]] | None = None, parallel: Sharding | None = None) -> Transformer:
    """The whole model, or one half of the split: "encoder" (embed, Engram, layers [0, d) and layer d's
    cache write) or "decoder" (layers [d, n), head, DSpark), d = the first decoder layer. `loaded(i)`: called
    after each layer i (a progress bar). `ranges`: layer ranges over devices (Transformer), cut to the
    half's layers. `parallel`: rank 0 of a parallel layout (model/parallel.py)."""
    path = Path(path)
    ckpt = open_checkpoint(path)
    args = ckpt.args
    d = args.first_decoder_layer
    layers = {None: range(args.n_layers), "encoder": range(0, d), "decoder": range(d, args.n_layers)}[half]
    token_map = None
    if args.engram_layer_ids and layers.start == 0:
        token_map = engram_token_map(path, args)
    return Transformer(args, ckpt, token_map, layers=layers, device=device, reference=reference, tiers=tiers,
                       loaded=loaded, ranges=ranges_within(ranges, layers), parallel=parallel)


def ranges_within(ranges: Sequence[tuple[range, str]] | None, layers: range) -> list[tuple[range, str]] | None:
    """The whole model's layer ranges over devices cut to `layers` (a half's): None when no range is left."""
    mine = [(range(max(r.start, layers.start), min(r.stop, layers.stop)), dev) for r, dev in ranges or ()]
    return [(r, dev) for r, dev in mine if len(r)] or None
