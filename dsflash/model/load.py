"""Build a model from a checkpoint directory: config, weights and the Engram token map."""

from __future__ import annotations

from pathlib import Path

from dsflash.checkpoint.reader import CheckpointError, open_checkpoint
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


def engram_token_map(path: Path, vocab_size: int) -> tuple[list[int], int]:
    from dsflash.tokenizer import compressed_token_map, load_tokenizer

    source = load_tokenizer(path) if (path / "tokenizer.json").exists() else StubVocabulary(vocab_size)
    return compressed_token_map(source)


def load_model(path: str | Path, half: str | None = None, device: str = "cpu", reference: bool = False,
               tiers: Tiers = RESIDENT) -> Transformer:
    """The whole model, or one half of the split: "encoder" (embed, Engram, layers [0, d) and layer d's
    cache write) or "decoder" (layers [d, n), head, DSpark), d = the first decoder layer."""
    path = Path(path)
    ckpt = open_checkpoint(path)
    args = ckpt.args
    d = args.first_decoder_layer
    layers = {None: range(args.n_layers), "encoder": range(0, d), "decoder": range(d, args.n_layers)}[half]
    token_map = None
    if args.engram_layer_ids and layers.start == 0:
        token_map, classes = engram_token_map(path, args.vocab_size)
        if classes != args.engram_compressed_vocab_size:
            if not (path / "tokenizer.json").exists():  # the usual cause: Engram's classes come from it
                raise CheckpointError(f"{path}: no tokenizer.json (Engram's token classes come from the "
                                      f"checkpoint's tokenizer; copy it into the checkpoint directory)")
            raise CheckpointError(f"{path}: the tokenizer gives {classes} Engram token classes, config "
                                  f"engram_compressed_vocab_size is {args.engram_compressed_vocab_size}")
    return Transformer(args, ckpt, token_map, layers=layers, device=device, reference=reference, tiers=tiers)
