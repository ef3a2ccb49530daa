"""The requests of benchmarks/spec_decode.py's workloads (its docstring describes each), a pure
function of (workload, count, seed, concurrency): every mode of a point, ours and vLLM's
(benchmarks/spec_decode_vllm.py), gets the same ones."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from benchmarks import throughput as tput

WORKLOADS = ("copy", "json", "random", "sampled", "schema")
JSON_MAX_TOKENS = 384
COPY_SLACK_TOKENS = 16  # the model may add a closing word or newline after the passage

TOPICS = (
    (
        "The old lighthouse on the northern cliff had not been lit for nearly forty years, and the paint on its door had faded to a pale grey.",
        "Fishermen in the village still told stories about the keeper, a quiet man named Elias who grew herbs in a small garden behind the tower.",
        "Every evening he climbed the one hundred and twelve steps, polished the great lens, and watched the weather come in from the sea.",
        "After he died, the council replaced the light with an automatic beacon on the breakwater and locked the tower for good.",
        "Last spring a young architect bought the building at auction, promising to restore the lantern room and open it to visitors.",
        "Now she leads a tour each Sunday for anyone who walks up the hill, and the small crowd at the door grows every week.",
    ),
    (
        "Honey bees communicate the location of food through a movement that scientists call the waggle dance.",
        "A forager returning to the hive walks in a straight line while shaking her body, then circles back to repeat the pattern.",
        "The angle of the straight run relative to vertical tells the other bees the direction of the flowers relative to the sun.",
        "The length of the run encodes the distance, with longer dances pointing to food that lies farther from the hive.",
        "Bees also adjust their dance as the day goes on, because the position of the sun in the sky keeps changing.",
        "When nectar is plentiful, dances become more vigorous and last longer, drawing more workers toward the richest patches.",
        "The waggle dance remains one of the few known cases of an animal signal that refers to a place far away in space.",
    ),
    (
        "Revenue for the third quarter rose eight percent compared with the same period last year, reaching four hundred million dollars.",
        "Growth came mainly from the services division, where new maintenance contracts offset weaker sales of hardware.",
        "Cash flow from operations remained strong, allowing the board to approve a dividend of twelve cents per share.",
        "Management expects demand in Europe to soften next year as several large customers postpone their upgrade plans.",
        "The first units of the new sensor platform are scheduled to ship in the spring, after a delay caused by a shortage of components.",
        "The chief executive said the results showed that the strategy announced two years ago was beginning to work.",
        "Shares rose three percent in early trading after the report was published, before settling slightly lower by the close.",
    ),
)
COPY_ASKS = (
    "Repeat the following passage exactly, word for word, without any changes or comments.",
    "Copy the text below verbatim. Do not add, remove or change anything.",
)
ENTITIES = (
    ("customers", ("id", "name", "email", "city", "plan")),
    ("products", ("sku", "title", "price", "currency", "in_stock")),
    ("sensors", ("sensor_id", "location", "temperature", "humidity", "status")),
)


@dataclass(frozen=True)
class Request:
    max_tokens: int
    messages: tuple[tuple[str, str], ...] = ()  # (role, content), rendered by the server
    token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    temperature: float = 0.0
    json_schema: str = ""  # a structured output's JSON schema (empty: none)


def build_requests(workload: str, n: int, seed: int, conc: int, tokenizer: Any, cap: int | None) -> list[Request]:
    """A pure function of its arguments: every mode of a point gets the same requests."""
    rng = np.random.default_rng([seed, WORKLOADS.index(workload), conc])
    out = []
    for _ in range(n):
        if workload == "copy":
            paragraphs = []
            for topic in (TOPICS[i] for i in rng.choice(len(TOPICS), size=2, replace=False)):
                keep = np.sort(rng.choice(len(topic), size=int(rng.integers(5, len(topic) + 1)), replace=False))
                paragraphs.append(" ".join(topic[i] for i in keep))
            passage = "\n\n".join(paragraphs)
            passage_tokens = len(tokenizer(passage, add_special_tokens=False).input_ids)
            ask = COPY_ASKS[rng.integers(len(COPY_ASKS))]
            out.append(Request(passage_tokens + COPY_SLACK_TOKENS, messages=(("user", f"{ask}\n\n{passage}"),)))
        elif workload == "json":
            entity, keys = ENTITIES[rng.integers(len(ENTITIES))]
            keys = (keys[0], *rng.permutation(keys[1:]).tolist())
            listed = ", ".join(f'"{k}"' for k in keys)
            ask = f"Produce a JSON array of {rng.integers(8, 16)} {entity}. Each object has the keys {listed}. Output only the JSON."
            chat = [{"role": "user", "content": ask}]
            # The answer begun, one key a line: left alone, a 135M model often writes one object and stops.
            text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            ids = tokenizer(text + f'[\n  {{\n    "{keys[0]}": ', add_special_tokens=False).input_ids
            out.append(Request(JSON_MAX_TOKENS, token_ids=tuple(ids)))
        elif workload == "schema":
            entity, keys = ENTITIES[rng.integers(len(ENTITIES))]
            count = int(rng.integers(8, 16))
            item = {"type": "object", "properties": {k: {"type": "string", "maxLength": 24} for k in keys}}
            item |= {"required": list(keys), "additionalProperties": False}
            schema = {"type": "array", "minItems": count, "maxItems": count, "items": item}
            ask = f"Produce a JSON array of {count} {entity} with the keys {', '.join(keys)}."
            out.append(Request(JSON_MAX_TOKENS, messages=(("user", ask),), json_schema=json.dumps(schema)))
    if workload in ("random", "sampled"):
        temperature = float(workload == "sampled")
        tokens = tput.make_workload(n, int(rng.integers(2**31)), len(tokenizer))
        out = [Request(m, token_ids=tuple(p), ignore_eos=True, temperature=temperature) for p, m in tokens]
    return [dataclasses.replace(r, max_tokens=min(r.max_tokens, cap or r.max_tokens)) for r in out]
