"""The least time a workload could take on this machine, by part: a roofline for throughput.py.

Pure arithmetic over a model's config, a workload's lengths and two measured machine figures
(benchmarks/machine_peaks.py); no torch. Notation, from config.json:

    H hidden_size        I intermediate_size   L num_hidden_layers   V vocab_size
    h num_attention_heads   g num_key_value_heads   d head_dim (default H / h)
    b bytes per weight and per KV element (2 for bfloat16, 4 for float32)

Weights a token goes through:

    W_layer = H*(h + 2g)*d  (q, k, v)  +  h*d*H  (o)  +  2*H*I  (gate, up)  +  I*H  (down)
    W_lin   = L * W_layer                W_head = V * H  (read whole by a step, tied or not)

Request r has a prompt of n_r tokens and asks for m_r output tokens. Its first output token is
sampled from the prompt's last position; each of the other m_r - 1 goes through a decode
forward, at 0-based position n_r + j - 1 (j = 1 .. m_r - 1), attending to c = n_r + j cached
tokens (itself included). Then:

    prefill linears   2 * W_lin * sum(n_r)                    flops (2 per weight per token)
    decode linears    2 * W_lin * sum(m_r - 1)                flops
    LM head           2 * W_head * sum(m_r)                   flops (rows that sample only)
    prefill attention 4*d*h*L * sum(n_r (n_r + 1) / 2)        flops (causal QK^T and PV,
                                                               2*d each per query-key pair)
    decode attention  4*d*h*L * sum_r sum_j (n_r + j)         flops
    weight reads      S * (W_lin + W_head) * b                bytes (once per step, S steps)
    KV reads          2*g*d*b*L * sum_r sum_j (n_r + j)       bytes (K and V of every cached
                                                               token, per layer, per decode token)

S is the number of steps our run made (the scheduler's counter), else max(m_r): the fewest
steps there can be when every request decodes in the same step.

Bounds, with P_2048 / P_96 the measured GEMM rate (flop/s) on the model's own layer shapes at
M = 2048 / 96 rows, P_head that of the LM head's shape at M = 96, and B the stream read
bandwidth (bytes/s):

    prefill linears   flops / P_2048
    decode linears    max(flops / P_96, S * W_lin * b / B)
    LM head           max(flops / P_head, S * W_head * b / B)
    attention         prefill flops / P_2048 + max(decode flops / P_96, KV bytes / B)
    everything else   0 (norms, rotary, embedding, sampling, the scheduler: not bounded here)

The total bound is the sum of the parts, and "% of bound" is bound / measured time: 100% would
be the machine's roofline. What this leaves out, so that the figure is a guide, not a law:
attention is not a GEMM, so P_2048 flatters it; a step that mixes prefill and decode tokens
would really cost max(compute, weight reads) once, where the sum above counts the prefill's
compute beside the decode's reads (the bound errs high by at most the smaller); writes (KV,
activations) and activations' reads are not counted; and P and B are what torch reaches here,
not the datasheet's figures.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int
    vocab: int
    tied: bool

    def __post_init__(self) -> None:
        for name in ("hidden", "intermediate", "heads", "kv_heads", "head_dim", "layers", "vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelShape:
        """From a Hugging Face config.json (a Llama-shaped decoder: q/k/v/o and a gated MLP)."""
        hidden = int(config["hidden_size"])
        heads = int(config["num_attention_heads"])
        return cls(
            hidden=hidden,
            intermediate=int(config["intermediate_size"]),
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or hidden // heads),
            layers=int(config["num_hidden_layers"]),
            vocab=int(config["vocab_size"]),
            tied=bool(config.get("tie_word_embeddings", False)),
        )

    def layer_linears(self) -> dict[str, tuple[int, int]]:
        """A layer's projections as (in, out) features, fused as the worker runs them."""
        h, g, d = self.heads, self.kv_heads, self.head_dim
        return {
            "qkv": (self.hidden, (h + 2 * g) * d),
            "o": (h * d, self.hidden),
            "gate_up": (self.hidden, 2 * self.intermediate),
            "down": (self.intermediate, self.hidden),
        }

    @property
    def layer_weights(self) -> int:
        return sum(k * n for k, n in self.layer_linears().values())

    @property
    def linear_weights(self) -> int:
        return self.layers * self.layer_weights

    @property
    def head_weights(self) -> int:
        return self.vocab * self.hidden


@dataclass(frozen=True)
class Work:
    """What a workload asks of the machine: flops and bytes by part (module docstring)."""

    prompt_tokens: int
    decode_tokens: int
    sampled_rows: int
    steps: int
    prefill_linear_flops: int
    decode_linear_flops: int
    lm_head_flops: int
    prefill_attention_flops: int
    decode_attention_flops: int
    linear_weight_bytes: int  # over all steps
    head_weight_bytes: int  # over all steps
    kv_read_bytes: int


def work(shape: ModelShape, lengths: Iterable[tuple[int, int]], dtype_bytes: int, steps: int | None = None) -> Work:
    """`lengths`: (prompt tokens, output tokens) per request; `steps`: our run's step count, or
    None for max(output tokens)."""
    pairs = list(lengths)
    if not pairs:
        raise ValueError("the workload has no requests")
    for n, m in pairs:
        if n < 1 or m < 1:
            raise ValueError(f"a request needs at least one prompt and one output token, got ({n}, {m})")
    prompt = sum(n for n, _ in pairs)
    decode = sum(m - 1 for _, m in pairs)
    sampled = sum(m for _, m in pairs)
    prefill_pairs = sum(n * (n + 1) // 2 for n, _ in pairs)
    # sum_{j=1}^{m-1} (n + j) = (m - 1) n + (m - 1) m / 2
    decode_context = sum((m - 1) * n + (m - 1) * m // 2 for n, m in pairs)
    s = steps if steps is not None else max(m for _, m in pairs)
    attention_per_pair = 4 * shape.head_dim * shape.heads * shape.layers
    return Work(
        prompt_tokens=prompt,
        decode_tokens=decode,
        sampled_rows=sampled,
        steps=s,
        prefill_linear_flops=2 * shape.linear_weights * prompt,
        decode_linear_flops=2 * shape.linear_weights * decode,
        lm_head_flops=2 * shape.head_weights * sampled,
        prefill_attention_flops=attention_per_pair * prefill_pairs,
        decode_attention_flops=attention_per_pair * decode_context,
        linear_weight_bytes=s * shape.linear_weights * dtype_bytes,
        head_weight_bytes=s * shape.head_weights * dtype_bytes,
        kv_read_bytes=2 * shape.kv_heads * shape.head_dim * dtype_bytes * shape.layers * decode_context,
    )


@dataclass(frozen=True)
class Peaks:
    """Measured rates: flop/s of the layer shapes at M=2048 and M=96, of the LM head at M=96,
    and the stream read bandwidth in bytes/s."""

    linear_m2048: float
    linear_m96: float
    head_m96: float
    read_bandwidth: float

    def __post_init__(self) -> None:
        for name in ("linear_m2048", "linear_m96", "head_m96", "read_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


def bound(w: Work, p: Peaks) -> dict[str, float]:
    """Seconds each part would take at the measured peaks (module docstring)."""
    return {
        "prefill_linear": w.prefill_linear_flops / p.linear_m2048,
        "decode_linear": max(w.decode_linear_flops / p.linear_m96, w.linear_weight_bytes / p.read_bandwidth),
        "lm_head": max(w.lm_head_flops / p.head_m96, w.head_weight_bytes / p.read_bandwidth),
        "attention": w.prefill_attention_flops / p.linear_m2048
        + max(w.decode_attention_flops / p.linear_m96, w.kv_read_bytes / p.read_bandwidth),
    }


# Our step profile's parts against the bound's: (our part, the bound's parts it covers).
PROFILE_PARTS = (
    ("linear", ("prefill_linear", "decode_linear")),
    ("attention", ("attention",)),
    ("lm_head", ("lm_head",)),
)


def compare(bounds: Mapping[str, float], wall_s: float, part_seconds: Mapping[str, float]) -> dict[str, Any]:
    """Bound against measured: overall (total bound / wall) and per part of our step profile
    (`part_seconds`: part -> seconds; empty when the run was not profiled). "rest" is the wall
    less the profiled parts, whose bound is 0."""
    total = sum(bounds.values())
    out: dict[str, Any] = {"bound_s": total, "wall_s": wall_s, "pct_of_bound": 100 * total / wall_s, "parts": {}}
    if not part_seconds:
        return out
    covered = 0.0
    for ours, theirs in PROFILE_PARTS:
        seconds = part_seconds.get(ours, 0.0)
        covered += seconds
        b = sum(bounds[t] for t in theirs)
        out["parts"][ours] = {"bound_s": b, "ours_s": seconds, "pct_of_bound": 100 * b / seconds if seconds else None}
    rest = max(wall_s - covered, 0.0)
    out["parts"]["rest"] = {"bound_s": 0.0, "ours_s": rest, "pct_of_bound": 0.0 if rest else None}
    return out


def report_lines(w: Work, p: Peaks, bounds: Mapping[str, float], vs_ours: Mapping[str, Any]) -> list[str]:
    """The roofline as throughput.py prints it: peaks, work, bound by part, ours against it."""
    lines = [
        f"roofline: GEMM {p.linear_m2048 / 1e9:.0f} GFLOP/s at M=2048, {p.linear_m96 / 1e9:.0f} at M=96 "
        f"(LM head {p.head_m96 / 1e9:.0f}); read bandwidth {p.read_bandwidth / 1e9:.1f} GB/s",
        f"  work: linears {(w.prefill_linear_flops + w.decode_linear_flops) / 1e9:.1f} GFLOP "
        f"(prefill {w.prefill_linear_flops / 1e9:.1f}), LM head {w.lm_head_flops / 1e9:.1f} GFLOP, "
        f"attention {(w.prefill_attention_flops + w.decode_attention_flops) / 1e9:.2f} GFLOP; "
        f"weight reads {(w.linear_weight_bytes + w.head_weight_bytes) / 1e9:.2f} GB ({w.steps} steps), "
        f"KV reads {w.kv_read_bytes / 1e9:.2f} GB",
        "  bound s: " + "  ".join(f"{name} {seconds:.3f}" for name, seconds in bounds.items()),
        f"  ours: {vs_ours['pct_of_bound']:.1f}% of bound overall "
        f"({vs_ours['bound_s']:.2f} s bound / {vs_ours['wall_s']:.2f} s wall)",
    ]
    for name, part in vs_ours["parts"].items():
        pct = "n/a" if part["pct_of_bound"] is None else f"{part['pct_of_bound']:.1f}%"
        lines.append(f"    {name:<10} bound {part['bound_s']:>7.3f} s  ours {part['ours_s']:>7.2f} s  {pct:>6}")
    return lines
