"""Paged KV-cache accounting: which physical blocks each sequence owns, on device and host.

The scheduler owns all capacity; workers only hold tensors. A block holds `block_size`
consecutive tokens; a sequence of n tokens owns ceil(n / block_size) blocks:

    tokens     0 ........ 15 | 16 ....... 31 | 32 .. 37
    table      [    7        ,      2        ,    9     ]   (physical ids, any order)
    slot of token t = table[t // block_size] * block_size + t % block_size

Blocks are shared by reference count:
  - prefix caching: a full block is indexed by a chain hash (parent hash + its tokens); a new
    sequence starts from the longest indexed prefix and computes only the rest;
  - forks (n samples, beams): a child starts with its parent's table. Writing a token into a
    block that someone else also references first copies it (copy-on-write):

        parent [4, 9*]   child [4, 9*]       9 holds 5 of 16 tokens, ref 2
        child appends    ->  copy 9 -> 12     child [4, 12], 9 ref 1, 12 ref 1

Swapping moves a group's unique device blocks to the host pool and back. Every move is
recorded as a (src, dst) pair that the next plan carries to the worker (`take_ops`).

Tables are mirrored into one flat int32 arena (`table_mirror.TableMirror`), so that a plan's
block tables are one vectorised gather whose size follows the blocks referenced.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from common.block_tables import BlockTables
from scheduler_svc.kv.block_pool import BlockPool
from scheduler_svc.kv.kv_events import KvEventQueue
from scheduler_svc.kv.prefix_chain import extend_chain, reusable_blocks
from scheduler_svc.kv.table_mirror import TableMirror


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, num_host_blocks: int = 0, enable_prefix_caching: bool = True
    ) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.block_size = block_size
        # What the prefix cache indexes and forgets, for gateways that mirror it (drained outside).
        self.kv_events = KvEventQueue()
        self.device = BlockPool(num_blocks, enable_prefix_caching, self.kv_events)
        self.host = BlockPool(num_host_blocks, enable_caching=False)
        self._tables: dict[int, list[int]] = {}
        self._host_tables: dict[int, list[int]] = {}
        self._hashes: dict[int, list[int]] = {}  # chain hash of each full block of the tokens
        self._indexed: dict[int, int] = {}  # leading table blocks already offered to the index
        self._ops: dict[str, list[tuple[int, int]]] = {"swap_out": [], "swap_in": [], "copy": []}
        self.mirror = TableMirror()

    # ---- sizes ----

    @property
    def num_blocks(self) -> int:
        return self.device.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.device.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.device.num_used

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks a sequence of `num_tokens` tokens occupies."""
        return -(-num_tokens // self.block_size)

    @property
    def tables(self) -> dict[int, list[int]]:
        """Device tables by sequence id, read-only: the planner's decode fast path reads them."""
        return self._tables

    def has_table(self, seq_id: int) -> bool:
        return seq_id in self._tables

    @property
    def has_pending_ops(self) -> bool:
        return any(self._ops.values())

    def block_table(self, seq_id: int) -> list[int]:
        return self._tables.get(seq_id, [])

    def host_table(self, seq_id: int) -> list[int]:
        return self._host_tables.get(seq_id, [])

    # ---- prefix cache ----

    def _chain(self, seq_id: int, token_ids: Sequence[int], num_blocks: int, salt: int) -> list[int]:
        """Chain hashes of the first `num_blocks` full blocks (extended lazily, tokens only grow;
        a sequence's salt never changes)."""
        hashes = self._hashes.setdefault(seq_id, [])
        extend_chain(hashes, token_ids, self.block_size, num_blocks, salt)
        return hashes

    def prompt_chain(self, token_ids: Sequence[int], salt: int = 0) -> list[int]:
        """Chain hashes of the blocks a new prompt may find in the prefix cache (`reusable_blocks`
        of them); empty when caching is off. For probes that attach nothing (routing, load)."""
        hashes: list[int] = []
        if self.device.enable_caching:
            extend_chain(hashes, token_ids, self.block_size, reusable_blocks(len(token_ids), self.block_size), salt)
        return hashes

    def cached_prefix_blocks(self, hashes: Sequence[int]) -> int:
        """How many leading blocks of a prompt with these chain hashes the prefix cache holds.

        A read-only probe (nothing is attached or revived): routing asks every worker group.
        """
        if not self.device.enable_caching:
            return 0
        for i, content_hash in enumerate(hashes):
            if self.device.lookup(content_hash) is None:
                return i
        return len(hashes)

    def prefix_hit(self, seq_id: int, token_ids: Sequence[int], salt: int = 0) -> list[int]:
        """Indexed blocks holding the longest prefix of `token_ids`; empty if caching is off.
        `salt` keys the chain (a LoRA adapter's: its KV differs for the same tokens).

        At most `reusable_blocks` of them.
        """
        if not self.device.enable_caching:
            return []
        limit = reusable_blocks(len(token_ids), self.block_size)
        hit: list[int] = []
        # The chain may be longer than `limit`: commit() hashes every computed block, and a
        # sequence that computed all of its tokens can be dropped before it samples one more.
        for content_hash in self._chain(seq_id, token_ids, limit, salt)[:limit]:
            block = self.device.lookup(content_hash)
            if block is None:
                break
            hit.append(block)
        return hit

    def admission_cost(self, hit: list[int], num_tokens: int) -> int:
        """Free blocks a new sequence takes to hold `num_tokens` after attaching `hit`."""
        revived = sum(1 for b in hit if self.device.is_cached(b))
        return self.blocks_for(num_tokens) - len(hit) + revived

    def attach(self, seq_id: int, hit: list[int]) -> None:
        """Start the table of a new sequence with the prefix-hit blocks."""
        if seq_id in self._tables:
            raise RuntimeError(f"sequence {seq_id} already has a table")
        for block in hit:
            self.device.incref(block)
        self._tables[seq_id] = list(hit)
        self._indexed[seq_id] = len(hit)
        self.mirror.set(seq_id, self._tables[seq_id])

    def commit(self, seq_id: int, token_ids: Sequence[int], num_computed: int, salt: int = 0) -> None:
        """Index the blocks that became full and computed, so later requests can reuse them."""
        full = num_computed // self.block_size
        done = self._indexed.get(seq_id, 0)
        if full <= done or not self.device.enable_caching:
            return
        table = self._tables[seq_id]
        hashes = self._chain(seq_id, token_ids, full, salt)
        size = self.block_size
        for i in range(done, full):
            if self.device.register(table[i], hashes[i]):
                parent = hashes[i - 1] if i else None
                self.kv_events.stored(hashes[i], parent, tuple(token_ids[i * size : (i + 1) * size]))
        self._indexed[seq_id] = full

    def reset_prefix_cache(self) -> int | None:
        """Forget every cached block; returns how many, or None while any block is in use.

        Only an idle pool is flushed (vLLM's rule): a block in use keeps its hash and would be
        back in the cache when released, so a flush under load would not empty the cache.
        """
        if self.device.num_used:
            return None
        return self.device.reset_cache()

    def indexed_hashes(self) -> set[int]:
        """Chain hashes of every block the prefix cache holds now."""
        return self.device.indexed_hashes()

    # ---- growth and copy-on-write ----

    def blocks_needed(self, seq_id: int, num_tokens: int, write_from: int | None = None) -> int:
        """Free blocks `allocate(seq_id, num_tokens, write_from)` takes (growth + copies)."""
        table = self._tables.get(seq_id, ())
        end = self.blocks_for(num_tokens)
        grow = max(0, end - len(table))
        if write_from is None:
            return grow
        ref = self.device.ref
        return grow + sum(1 for i in range(write_from // self.block_size, min(end, len(table))) if ref[table[i]] > 1)

    def can_allocate(self, seq_id: int, num_tokens: int, write_from: int | None = None, reserve: int = 0) -> bool:
        return self.blocks_needed(seq_id, num_tokens, write_from) + reserve <= self.device.num_free

    def allocate(self, seq_id: int, num_tokens: int, write_from: int | None = None) -> None:
        """Make `seq_id` hold `num_tokens` tokens with positions >= `write_from` writable.

        `write_from` None: only the new blocks are written (no copy-on-write check).
        """
        needed = self.blocks_needed(seq_id, num_tokens, write_from)
        if needed > self.device.num_free:
            raise RuntimeError(f"allocate: seq {seq_id} needs {needed} blocks, {self.device.num_free} free")
        table = self._tables.get(seq_id)
        if table is None:
            table = self._tables[seq_id] = []
            self.mirror.set(seq_id, self._tables[seq_id])
        end = self.blocks_for(num_tokens)
        first = len(table) if write_from is None else write_from // self.block_size
        for i in range(first, min(end, len(table))):
            old = table[i]
            if self.device.ref[old] > 1:
                new = self.device.take()
                self._ops["copy"].append((old, new))
                self.device.decref(old)
                table[i] = new
                self.mirror.set_one(seq_id, i, new)
        if len(table) < end:
            start = len(table)
            table.extend(self.device.take() for _ in range(end - start))
            self.mirror.set_range(seq_id, start, table[start:])

    def trim(self, seq_id: int, num_blocks: int) -> None:
        """Give back the sequence's blocks past its first `num_blocks`: those a step took for
        draft tokens the model rejected (taken fresh then, so no one else holds them)."""
        table = self._tables.get(seq_id)
        if table is None or len(table) <= num_blocks:
            return
        for block in reversed(table[num_blocks:]):
            self.device.decref(block)
        del table[num_blocks:]

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent (copied on the first write)."""
        if child_id in self._tables or child_id in self._host_tables:
            raise RuntimeError(f"sequence {child_id} already has a table")
        table = list(self._tables.get(parent_id, ()))
        for block in table:
            self.device.incref(block)
        self._tables[child_id] = table
        self._hashes[child_id] = list(self._hashes.get(parent_id, ()))
        self._indexed[child_id] = self._indexed.get(parent_id, 0)
        self.mirror.set(child_id, table)

    def share_prefix(self, src_id: int, dst_id: int, num_blocks: int) -> None:
        """Start `dst_id`'s table with the first `num_blocks` blocks of `src_id` (shared)."""
        if dst_id in self._tables or dst_id in self._host_tables:
            raise RuntimeError(f"sequence {dst_id} already has a table")
        table = self._tables[src_id][:num_blocks]
        for block in table:
            self.device.incref(block)
        self._tables[dst_id] = table
        self._indexed[dst_id] = 0
        self.mirror.set(dst_id, table)

    def free(self, seq_id: int) -> int:
        """Drop every device and host block of `seq_id`; returns how many device blocks.

        Released in reverse, so the tail of a cached prefix is evicted before its head.
        """
        table = self._tables.pop(seq_id, [])
        for block in reversed(table):
            self.device.decref(block)
        for block in self._host_tables.pop(seq_id, []):
            self.host.decref(block)
        self._hashes.pop(seq_id, None)
        self._indexed.pop(seq_id, None)
        self.mirror.release(seq_id)
        return len(table)

    def drop_device_blocks(self, seq_id: int) -> None:
        """Preemption by recompute: free the blocks but keep the hashes of the tokens."""
        table = self._tables.pop(seq_id, [])
        for block in reversed(table):
            self.device.decref(block)
        self._indexed[seq_id] = 0
        self.mirror.release(seq_id)

    # ---- swapping ----

    def unique_blocks(self, seq_ids: Iterable[int], host: bool = False) -> set[int]:
        tables = self._host_tables if host else self._tables
        return {b for s in seq_ids for b in tables.get(s, ())}

    def can_swap_out(self, seq_ids: Iterable[int]) -> bool:
        return len(self.unique_blocks(seq_ids)) <= self.host.num_free

    def swap_out(self, seq_ids: Sequence[int]) -> int:
        """Move the sequences' device blocks to the host; shared blocks move once. Returns blocks moved."""
        moved = self._move(seq_ids, self._tables, self._host_tables, self.device, self.host, "swap_out")
        for seq_id in seq_ids:
            self._indexed[seq_id] = 0
            self.mirror.release(seq_id)
        return moved

    def can_swap_in(self, seq_ids: Iterable[int], reserve: int = 0) -> bool:
        return len(self.unique_blocks(seq_ids, host=True)) + reserve <= self.device.num_free

    def swap_in(self, seq_ids: Sequence[int]) -> int:
        moved = self._move(seq_ids, self._host_tables, self._tables, self.host, self.device, "swap_in")
        for seq_id in seq_ids:
            self.mirror.set(seq_id, self._tables[seq_id])
        return moved

    def _move(
        self,
        seq_ids: Sequence[int],
        src_tables: dict[int, list[int]],
        dst_tables: dict[int, list[int]],
        src: BlockPool,
        dst: BlockPool,
        op: str,
    ) -> int:
        if len(self.unique_blocks(seq_ids, host=src is self.host)) > dst.num_free:
            raise RuntimeError(f"{op}: not enough free blocks")
        mapping: dict[int, int] = {}
        for seq_id in seq_ids:
            table = src_tables.pop(seq_id, [])
            moved = []
            for block in table:
                if block in mapping:
                    dst.incref(mapping[block])
                else:
                    mapping[block] = dst.take()
                    self._ops[op].append((block, mapping[block]))
                moved.append(mapping[block])
                src.decref(block)
            dst_tables[seq_id] = moved
        return len(mapping)

    def take_ops(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(swap_out, swap_in, copy) pairs recorded since the last call, as int32 [k, 2]."""
        out = tuple(np.asarray(self._ops[k], dtype=np.int32).reshape(-1, 2) for k in ("swap_out", "swap_in", "copy"))
        for pairs in self._ops.values():
            pairs.clear()
        return out  # type: ignore[return-value]

    # ---- the table mirror ----

    @property
    def rows_epoch(self) -> int:
        """Moves whenever a sequence's mirror start changes (see `rows_of`)."""
        return self.mirror.epoch

    def rows_of(self, seq_ids: Sequence[int]) -> np.ndarray:
        """The sequences' mirror starts, for `tables_at`, valid while `rows_epoch` holds."""
        return self.mirror.starts_of(seq_ids)

    def tables_at(self, rows: np.ndarray, lens: np.ndarray) -> BlockTables:
        """The first lens[i] blocks of the table at mirror start rows[i], ragged."""
        return self.mirror.gather(rows, lens)

    def block_tables(self, seq_ids: Sequence[int]) -> BlockTables:
        """The sequences' whole device tables, ragged."""
        lens = np.array([len(self._tables[s]) for s in seq_ids], dtype=np.int64)
        return self.tables_at(self.rows_of(seq_ids), lens)

    # ---- checks ----

    def check_integrity(self) -> None:
        """Pools consistent; ref counts = table references; no block in two places; mirror true."""
        for pool, tables in ((self.device, self._tables), (self.host, self._host_tables)):
            refs: dict[int, int] = {}
            for table in tables.values():
                for block in table:
                    if not 0 <= block < pool.num_blocks:
                        raise AssertionError(f"block id {block} out of range")
                    refs[block] = refs.get(block, 0) + 1
            pool.check_integrity(refs)
        if set(self._tables) & set(self._host_tables):
            raise AssertionError("a sequence holds both device and host blocks")
        if len(self.mirror) != len(self._tables):
            raise AssertionError(f"the mirror holds {len(self.mirror)} tables, the manager {len(self._tables)}")
        for seq_id, table in self._tables.items():
            if seq_id not in self.mirror or self.mirror.row(seq_id, len(table)) != table:
                raise AssertionError(f"table mirror of seq {seq_id} is stale")
