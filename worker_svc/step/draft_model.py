"""Speculative decoding's draft model: a smaller model of the same vocabulary that the worker
runs beside the served one, to propose each drafting sequence's next draft tokens.

Its KV cache has as many blocks as the model's and is indexed by the same block tables, so the
scheduler plans one set of blocks for both. It follows every step: the plan's tokens run
through it too (at the slots the model writes), so its cache holds every computed position of
every sequence, including blocks the prefix cache later shares and blocks swapped out and in.
After the model has sampled, it decodes greedily from each proposing row's new token, one
position at a time, writing at the positions past it that the plan's table reaches
(plan.propose_lens); the next step's verification rewrites them with the model's.

Greedy proposals are a deterministic function of the tokens so far, a one-hot proposal, for
which rejection sampling (worker_svc/sampling/draft_verifier.py) keeps the output distributed
exactly as without drafts.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import structlog
import torch

from common.block_tables import BlockTables
from common.model_spec import served_context
from common.plan import StepPlan
from worker_svc.device.host_copy import to_device, to_host
from worker_svc.step.kv_cache import KVCache, bytes_per_block
from worker_svc.step.loader import head_dim_of, load_config, load_model, resolve_attention_backend
from worker_svc.step.step_buckets import pad_rows

log = structlog.get_logger(__name__)


class DraftModel:
    """`path`'s model loaded for a worker whose model has `vocab_size` tokens and serves
    `max_model_len` positions with `attention_backend`; ValueError where it cannot draft for it."""

    def __init__(
        self,
        path: str,
        dtype: torch.dtype,
        device: torch.device,
        attention_backend: str,
        vocab_size: int,
        max_model_len: int,
    ) -> None:
        if not Path(path).is_dir():
            raise ValueError(f"--speculative-model {path}: not a model directory")
        config = load_config(path)
        backend = resolve_attention_backend("auto", device, dtype, head_dim_of(config))
        if attention_backend != "torch" and backend != attention_backend:
            raise ValueError(
                f"--speculative-model {path}: its heads take the {backend} attention kernels, the model's "
                f"the {attention_backend} ones; a draft model runs with the model's"
            )
        positions = served_context(config, 0)
        if positions < max_model_len:
            raise ValueError(
                f"--speculative-model {path}: its positions reach {positions}, the model serves "
                f"{max_model_len}; lower --max-model-len"
            )
        self.name = Path(path).name
        self.device = device
        self.dtype = dtype
        self.model = load_model(path, dtype, device, max_positions=max_model_len, attention_backend=attention_backend)
        if self.model.shape.vocab_size > vocab_size:
            raise ValueError(
                f"--speculative-model {path}: a vocabulary of {self.model.shape.vocab_size} tokens, the model's "
                f"{vocab_size}; a draft model shares the model's tokenizer"
            )
        self.kv: KVCache | None = None

    def block_bytes(self, block_size: int) -> int:
        """What one block of its cache holds (the worker sizes both caches together)."""
        return bytes_per_block(self.model.shape, block_size, self.dtype)

    def allocate(self, num_blocks: int, block_size: int, num_cpu_blocks: int) -> None:
        self.kv = KVCache(self.model.shape, num_blocks, block_size, self.dtype, self.device, num_cpu_blocks)
        log.info("draft_kv_cache_allocated", draft_model=self.name, num_blocks=num_blocks, gib=self.kv.nbytes / 2**30)

    def block_ops(self, plan: StepPlan) -> None:
        """The plan's swaps and copies, on this cache as on the model's."""
        assert self.kv is not None
        self.kv.swap_out(plan.swap_out)
        self.kv.swap_in(plan.swap_in)
        self.kv.copy(plan.copy)

    def follow(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: object) -> None:
        """The step's tokens through the draft model: its cache at their slots. Before its
        cache exists (the memory profile's steps, on CUDA) there is nothing to follow."""
        if self.kv is not None:
            self.model(input_ids, positions, self.kv.layers, meta)

    def propose(
        self,
        tokens: np.ndarray,
        positions: np.ndarray,
        tables: BlockTables,
        counts: np.ndarray,
        pad: Callable[[int], int] | None,
    ) -> np.ndarray:
        """int32 [sum(counts)]: greedy continuations, counts[i] tokens of row i fed `tokens[i]`
        at `positions[i]` first, row after row; `tables` (the rows' own) reach position +
        counts[i] - 1. `pad`: the row count the CPU kernels' GEMMs run at."""
        assert self.kv is not None
        bs, attention = self.kv.block_size, self.model.attention
        out = np.zeros((len(tokens), int(counts.max())), np.int32)
        ids, pos = tokens.astype(np.int64), positions.astype(np.int64)
        for i in range(out.shape[1]):
            live = np.flatnonzero(counts > i)  # a row stops where its table does
            n = live.size
            table = tables if n == len(tokens) else tables.take(live)
            width = pad(n) if pad is not None else n  # padded rows write nowhere (slot -1)
            at = pos[live]
            slots = pad_rows(table.lookup(np.arange(n), at // bs) * bs + at % bs, width, -1)
            meta = attention.build_metadata(np.ones(n, np.int32), at.astype(np.int32), table, slots, bs, self.device)
            feed = [to_device(pad_rows(a, width, 0), self.device) for a in (ids[live], at)]
            hidden = self.model(feed[0], feed[1], self.kv.layers, meta)
            logits = self.model.compute_logits(hidden[:n], upcast=False)
            (picked,) = to_host(logits.argmax(dim=-1).to(torch.int32))
            out[live, i] = picked
            ids[live], pos[live] = picked, at + 1
        return out[np.arange(out.shape[1]) < counts[:, None]]
