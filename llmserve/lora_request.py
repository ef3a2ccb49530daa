"""`LoRARequest`: the LoRA adapter an offline request generates with, in vLLM's shape.

    llm = LLM(enable_lora=True, max_lora_rank=16)
    llm.generate(prompts, params, lora_request=LoRARequest("sql", 1, "/adapters/sql"))

An adapter the engine does not know yet is registered on first use (its files checked as a
LoadAdapter call would); `lora_modules=` registers them at start and a plain name then selects one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    # vLLM's integer id; the engine names adapters by lora_name and keeps the id only for callers
    # that carry it around.
    lora_int_id: int = 0
    lora_path: str = ""

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("LoRARequest.lora_name must not be empty")
