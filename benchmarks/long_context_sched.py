"""The runs of benchmarks/long_context.py that need no model: the scheduler alone, answered
by scheduler_bench.py's fake worker through both wires.

    plan  decode steps of --short-rows rows, without and with one more row of --long-tokens:
          CPU and encoded bytes per plan
    kv    requests of log-uniform lengths on a --kv-blocks pool: after each step is planned,
          the tokens its sequences hold over the slots of the blocks in use
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import numpy as np

from benchmarks import scheduler_bench as sb
from benchmarks import throughput as tput
from common import worker_wire
from common.config import SchedulerConfig
from common.pb.llmserve.v1 import worker_pb2
from common.plan import StepPlan
from scheduler_svc.kv.block_manager import BlockManager
from scheduler_svc.sched.scheduler import Scheduler

BLOCK = sb.BLOCK_SIZE


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(tput.MIN_TOKEN_ID, 49152, size=n).tolist()


def _scheduler(num_blocks: int, max_model_len: int, budget: int, max_seqs: int = 256) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget)
    bm = BlockManager(num_blocks, BLOCK, num_host_blocks=num_blocks // 4)
    return Scheduler(config, bm, max_model_len, sb.EOS_TOKEN_IDS, block_bytes=sb.BLOCK_BYTES)


def _apply(sched: Scheduler, plan: StepPlan) -> None:
    """The fake worker's answer to `plan`, through both wires, applied."""
    result = sb.fake_worker(worker_wire.encode_plan(plan).SerializeToString())
    sched.update(plan, worker_wire.decode_result(worker_pb2.StepResult.FromString(result), plan.num_seqs))


def plan_cost(args: argparse.Namespace, with_long: bool) -> dict[str, Any]:
    """Decode steps of every row at once, after an untimed prefill (the long row's too)."""
    lens = [args.short_tokens] * args.short_rows + ([args.long_tokens] if with_long else [])
    out = args.plan_steps + 64
    blocks = sum(-(-(n + out) // BLOCK) + 2 for n in lens)
    sched = _scheduler(blocks, max(lens) + out + 1, budget=65536, max_seqs=len(lens))
    sb._fill_for_decode(sched, [prompt(n, 1000 + i) for i, n in enumerate(lens)], out)
    times, build = sb.StepTimes(), sb.BuildTimer()
    with build.installed():
        for _ in range(args.plan_steps):
            sb.timed_step(sched, times, build)
    sched.abort_all()
    summary = sb.summarize(times)
    keys = ("steps", "plan_bytes_mean", "total_us", "schedule_us", "build_plan_us", "encode_us", "update_us")
    return {"rows": len(lens), "plan_bytes_max": int(max(times.plan_bytes)), **{k: summary[k] for k in keys}}


def run_plan(args: argparse.Namespace) -> dict[str, Any]:
    plain, long = plan_cost(args, False), plan_cost(args, True)
    ratios = {"bytes_ratio": long["plan_bytes_mean"] / plain["plan_bytes_mean"]}
    ratios["ms_ratio"] = long["total_us"]["mean"] / plain["total_us"]["mean"]
    return {"without_long": plain, "with_long": long, **ratios}


def kv_efficiency(args: argparse.Namespace) -> dict[str, Any]:
    """Sampled after each step is planned, when its tables cover every token it feeds. A
    sequence holds the tokens computed before the step, plus those the step feeds."""
    rng = np.random.default_rng(0)
    low, high = args.kv_lens
    totals = np.exp(rng.uniform(math.log(low), math.log(high), args.kv_requests)).astype(int)
    outputs = np.clip((totals * rng.uniform(0.05, 0.5, args.kv_requests)).astype(int), 1, totals - 1)
    sched = _scheduler(args.kv_blocks, high + 1, budget=args.chunk)
    bm, added, samples = sched.block_manager, 0, []
    while added < len(totals) or sched.has_work:
        while added < len(totals) and sched.num_waiting < 32:  # a backlog, as a busy server has
            ids = prompt(max(int(totals[added] - outputs[added]), 1), added)
            sched.add(sb.make_group(sched, added, sb.Request(ids, int(outputs[added]))))
            added += 1
        plan = sched.schedule()
        if plan is None:
            raise RuntimeError(f"no plan with {sched.num_waiting} waiting and {sched.num_running} running")
        fed = dict(zip(plan.seq_ids.tolist(), (plan.context_lens + plan.query_lens).tolist()))
        seqs = [s for g in sched.queues.running for s in g.seqs if bm.has_table(s.seq_id)]
        samples.append((sum(fed.get(s.seq_id, s.num_computed_tokens) for s in seqs), bm.num_used_blocks * BLOCK))
        _apply(sched, plan)
    held, slots = (np.array(x, dtype=np.float64) for x in zip(*samples))
    pool = bm.num_blocks * BLOCK
    eff = held / np.maximum(slots, 1)
    busy = slots >= pool / 2
    out = {"requests": len(totals), "tokens": int(totals.sum()), "steps": len(samples), "pool_blocks": bm.num_blocks}
    out |= {"preemptions": sched.queues.num_preemptions, "efficiency_token_weighted": float(held.sum() / slots.sum())}
    out |= {"efficiency_mean": float(eff.mean()), "efficiency_min": float(eff.min())}
    out["efficiency_min_pool_half_used"] = float(eff[busy].min()) if busy.any() else None
    out["pool_fragmented_share_mean"] = float(((slots - held) / pool).mean())
    return out | {"pool_used_share_mean": float((slots / pool).mean()), "integrity": sb.integrity(sched)}
