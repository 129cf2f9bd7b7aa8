"""Prefix caching for causal models: a prompt's leading blocks are computed once and reused.

A decoder token's keys, values and final hidden state depend only on the tokens before it, so requests
that start with the same tokens (an instruction prompt) share them. Prompts are cut into blocks of
`BLOCK_SIZE` tokens, each named by a hash chained over all the blocks before it (vLLM's automatic prefix
caching scheme, https://docs.vllm.ai/en/latest/design/prefix_caching.html). A request whose first blocks
are cached starts its prefill after them: their keys/values are copied into its KV cache, and their hidden
states feed its pooling state, so every pooling type (not only LAST) gives the same result as without
the cache. Blocks are kept in least-recently-used order up to a token capacity.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

import torch

BLOCK_SIZE = 16


def block_hashes(token_ids: list[int]) -> list[bytes]:
    """One chained digest per full block of the prompt."""
    out, parent = [], b""
    for b in range(len(token_ids) // BLOCK_SIZE):
        block = array("q", token_ids[b * BLOCK_SIZE : (b + 1) * BLOCK_SIZE]).tobytes()
        parent = hashlib.blake2b(parent + block, digest_size=16).digest()
        out.append(parent)
    return out


@dataclass
class _Block:
    k: torch.Tensor  # [layers, BLOCK_SIZE, kv_heads, head_dim]
    v: torch.Tensor
    hidden: torch.Tensor  # [BLOCK_SIZE, hidden] final hidden states


class PrefixCache:
    def __init__(self, capacity_tokens: int):
        self.capacity_blocks = max(0, capacity_tokens // BLOCK_SIZE)
        self.blocks: OrderedDict[bytes, _Block] = OrderedDict()
        self.hit_tokens = 0

    def __len__(self) -> int:
        return len(self.blocks)

    def probe(self, request) -> tuple[int, bytes | None]:
        """(leading tokens cached, hash of the first block that is not): the scheduler's view."""
        hashes = request.block_hashes or []
        # At least one token is always computed, so the request's last chunk exists.
        usable = min(len(hashes), (request.num_tokens - 1) // BLOCK_SIZE)
        n = 0
        while n < usable and hashes[n] in self.blocks:
            n += 1
        return n * BLOCK_SIZE, hashes[n] if n < len(hashes) else None

    def load(self, request, num_tokens: int, kv_cache) -> torch.Tensor:
        """Copy the first `num_tokens` tokens' keys/values into `kv_cache`; return their hidden states."""
        hidden = []
        for b in range(num_tokens // BLOCK_SIZE):
            block = self.blocks[request.block_hashes[b]]  # probed in this same step, so present
            self.blocks.move_to_end(request.block_hashes[b])
            sl = slice(b * BLOCK_SIZE, (b + 1) * BLOCK_SIZE)
            kv_cache.k[:, sl] = block.k
            kv_cache.v[:, sl] = block.v
            hidden.append(block.hidden)
        self.hit_tokens += num_tokens
        return torch.cat(hidden)

    def insert(self, request, start: int, num_tokens: int, hidden: torch.Tensor) -> None:
        """Store the full blocks inside tokens [start, start + num_tokens) of `request`, whose keys/values
        are in its KV cache and whose final hidden states are `hidden` (rows of this chunk)."""
        if not self.capacity_blocks or request.kv_cache is None:
            return
        hashes = request.block_hashes or []
        first, end = -(-start // BLOCK_SIZE), min(len(hashes), (start + num_tokens) // BLOCK_SIZE)
        for b in range(first, end):
            key = hashes[b]
            if key in self.blocks:
                self.blocks.move_to_end(key)
                continue
            if b and hashes[b - 1] not in self.blocks:
                break  # a chain with a gap could never be matched
            sl = slice(b * BLOCK_SIZE, (b + 1) * BLOCK_SIZE)
            rows = slice(b * BLOCK_SIZE - start, (b + 1) * BLOCK_SIZE - start)
            self.blocks[key] = _Block(
                request.kv_cache.k[:, sl].clone(), request.kv_cache.v[:, sl].clone(), hidden[rows].clone()
            )
            while len(self.blocks) > self.capacity_blocks:
                self.blocks.popitem(last=False)
