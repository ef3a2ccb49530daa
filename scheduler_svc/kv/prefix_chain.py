"""The prefix cache's keys: a chain hash per full block of tokens, and which blocks of a
prompt the cache may supply.

A block's hash covers its tokens and its parent's hash, so equal hashes mean equal whole
prefixes; a LoRA adapter's salt starts a chain of its own (its KV differs for the same
tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

_ROOT_HASH = 0x6C6D7365  # parent hash of a sequence's first block


def reusable_blocks(num_tokens: int, block_size: int) -> int:
    """Full blocks of a prompt of `num_tokens` that the prefix cache may supply: every block
    before the one holding its last token. That token is always computed, because the step
    that feeds it yields the logits the first output token is sampled from."""
    return (num_tokens - 1) // block_size


def extend_chain(hashes: list[int], token_ids: Sequence[int], block_size: int, num_blocks: int, salt: int = 0) -> None:
    """Append the chain hashes of full blocks len(hashes)..num_blocks-1 of `token_ids`; a
    non-zero `salt` (a LoRA adapter's) starts a chain of its own."""
    parent = hashes[-1] if hashes else (_ROOT_HASH if not salt else hash((_ROOT_HASH, salt)))
    for i in range(len(hashes), num_blocks):
        parent = hash((parent, tuple(token_ids[i * block_size : (i + 1) * block_size])))
        hashes.append(parent)
