"""An embedded tiny causal LM: nothing is downloaded."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class TinyConfig:
    vocab: int = 512
    hidden: int = 32
    layers: int = 2
    seq: int = 8
    unused: bool = False  # add a parameter no loss touches (find_unused_parameters cases)
    tied: bool = False  # lm_head shares the embedding's weight


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.proj(x))


class TinyCausalLM(nn.Module):
    """Embedding, residual tanh blocks, an ``lm_head`` without bias. ``forward`` returns hidden states: the
    fused losses read ``lm_head.weight`` themselves, which is exactly the pattern that skips the wrapper."""

    def __init__(self, config: TinyConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab, config.hidden)
        self.blocks = nn.ModuleList(Block(config.hidden) for _ in range(config.layers))
        self.lm_head = nn.Linear(config.hidden, config.vocab, bias=False)
        if config.tied:
            self.lm_head.weight = self.embed.weight
        if config.unused:
            self.unused = nn.Linear(config.hidden, config.hidden)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return x


def build_model(config: TinyConfig, seed: int = 0) -> TinyCausalLM:
    """The same weights on every rank and in the single-process reference."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return TinyCausalLM(config)


class StagePiece(nn.Module):
    """A pipeline stage's part of :class:`TinyCausalLM`: the embedding, some blocks, the head (read by a fused loss,
    never called). Its forward takes token ids on the first stage, hidden states on the others."""

    def __init__(self, embed: nn.Module | None = None, blocks: tuple[nn.Module, ...] = (),
                 head: nn.Module | None = None) -> None:  # fmt: skip
        super().__init__()
        self.embed = embed
        self.blocks = nn.ModuleList(blocks)
        self.lm_head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return x


def stage_pieces(model: TinyCausalLM, stages: int) -> list[StagePiece]:
    """The model cut into ``stages`` parts, its own modules shared: 2 (the embedding and the first half of the
    blocks; the rest and the head), or one per embedding, block and head."""
    blocks = list(model.blocks)
    if stages == 2:
        half = len(blocks) // 2
        return [
            StagePiece(model.embed, tuple(blocks[:half])),
            StagePiece(blocks=tuple(blocks[half:]), head=model.lm_head),
        ]
    if stages != len(blocks) + 2:
        raise ValueError(f"{len(blocks)} blocks cut into 2 stages, or {len(blocks) + 2} (one part each); not {stages}")
    return [StagePiece(model.embed), *(StagePiece(blocks=(block,)) for block in blocks), StagePiece(head=model.lm_head)]
