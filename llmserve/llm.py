"""`LLM`: offline batch generation in one call, shaped like vLLM's.

    from llmserve import LLM, SamplingParams

    with LLM(dtype="float32", max_num_seqs=64) as llm:
        for out in llm.generate(["Hello, my name is", "The capital of France is"], SamplingParams(max_tokens=32)):
            print(out.outputs[0].text)

It starts what `llmserve up` starts, without a port (`LocalEngine`), and sends every prompt of
a call at once so the scheduler batches them as it would concurrent clients. Prompts are
tokenized here, so each output carries its prompt's token ids and a too-long prompt can be cut
(`truncate_prompt_tokens`) before it is sent.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import weakref
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import structlog

from common import log as logsetup
from common.errors import LlmserveError
from llmserve.engine_args import engine_args
from llmserve.local_engine import LocalEngine, python_error
from llmserve.lora_request import LoRARequest
from llmserve.outputs import RequestOutput, request_output
from llmserve.sampling_params import SamplingParams, StructuredOutputsParams
from scheduler_svc.engine.request import GenerationRequest
from scheduler_svc.text.structured_output import StructuredOutput

if TYPE_CHECKING:
    from typing import Self

# A prompt: text, {"prompt": text} or {"prompt_token_ids": [ids]} (vLLM's TextPrompt and TokensPrompt).
Prompt = str | Mapping[str, Any]
Conversation = Sequence[Mapping[str, Any]]  # [{"role": "user", "content": "..."}, ...]
Params = SamplingParams | Sequence[SamplingParams] | None
# A LoRA adapter for every prompt, or one per prompt (None: the base model); a name selects an
# adapter the engine already serves (lora_modules=...).
Adapters = LoRARequest | str | Sequence[LoRARequest | str | None] | None


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "auto",
        tp: int = 1,
        tensor_parallel_size: int | None = None,
        pipeline_parallel_size: int | None = None,
        seed: int | None = None,
        log_level: str = "warning",
        **engine_options: Any,
    ) -> None:
        """`model`: a Hugging Face model directory (default: the prepared SmolLM2-135M-Instruct).
        `engine_options`: the other `llmserve up` flags by name (max_num_seqs, block_size,
        kv_cache_gb, attention_backend, device, workers, ...); an unknown name is a TypeError.
        `seed`: requests without their own seed draw one from this seed's stream, so a run
        repeats. `log_level` is the engine's and the workers'."""
        if tensor_parallel_size is not None:  # vLLM's name for tp
            tp = tensor_parallel_size
        if pipeline_parallel_size is not None:  # and for pp
            engine_options["pp"] = pipeline_parallel_size
        if not structlog.is_configured():
            logsetup.configure(log_level)
        args = engine_args(model, log_level, {"dtype": dtype, "tp": tp, **engine_options})
        self._engine = LocalEngine(args)
        # A forgotten LLM (never closed, or alive at exit) still ends its processes; the
        # finalizer holds the engine, never the LLM, or the LLM could not be collected.
        self._finalizer = weakref.finalize(self, self._engine.close)
        self._seeds = random.Random(seed) if seed is not None else None
        self._ids = itertools.count()

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the worker processes (each rank group's launcher when tp x pp > 1)."""
        return [w.proc.pid for w in self._engine.workers if w.proc is not None]

    def get_tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer (transformers' fast tokenizer)."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self._engine.model)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: Params = None,
        use_tqdm: bool = True,
        lora_request: Adapters = None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. `sampling_params`: one for every prompt, or
        a list with one per prompt; default SamplingParams(). `lora_request`: the LoRA adapter
        of every prompt, or a list with one per prompt (None: the base model)."""
        items = [prompts] if isinstance(prompts, (str, Mapping)) else list(prompts)
        resolved = [self._prompt(i, p) for i, p in enumerate(items)]
        return self._run(resolved, sampling_params, use_tqdm, lora_request)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: Params = None,
        use_tqdm: bool = True,
        lora_request: Adapters = None,
    ) -> list[RequestOutput]:
        """Generate the next turn of one conversation or of each of a list of them, rendered with
        the model's chat template and its generation prompt."""
        conversations = [messages] if not messages or isinstance(messages[0], Mapping) else list(messages)
        resolved = [self._conversation(i, c) for i, c in enumerate(conversations)]  # type: ignore[arg-type]
        return self._run(resolved, sampling_params, use_tqdm, lora_request)

    def list_loras(self) -> list[str]:
        """Names of the LoRA adapters the engine serves."""
        return [a.name for a in self._engine.engine.adapters.list()]

    def close(self) -> None:
        """Stop the engine and its worker processes and remove their socket directory."""
        self._finalizer()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- internals ----

    def _prompt(self, i: int, prompt: Prompt) -> tuple[str | None, list[int]]:
        """(text, token ids) of one prompt."""
        if isinstance(prompt, str):
            return prompt, self._engine.tokenizer.encode(prompt)
        if not isinstance(prompt, Mapping) or len(prompt) != 1 or not {"prompt", "prompt_token_ids"} & set(prompt):
            raise ValueError(
                f"prompts[{i}]: want a string, {{'prompt': str}} or {{'prompt_token_ids': [int, ...]}}, got {prompt!r}"
            )
        if "prompt" in prompt:
            if not isinstance(prompt["prompt"], str):
                raise ValueError(f"prompts[{i}].prompt: want a string, got {prompt['prompt']!r}")
            return self._prompt(i, prompt["prompt"])
        ids = prompt["prompt_token_ids"]
        if isinstance(ids, (str, bytes)) or not all(isinstance(t, int) for t in ids):
            raise ValueError(f"prompts[{i}].prompt_token_ids: want a list of token ids, got {ids!r}")
        return None, list(ids)

    def _conversation(self, i: int, conversation: Conversation) -> tuple[str | None, list[int]]:
        template = self._engine.chat_template
        if template is None:
            raise ValueError(f"model {self._engine.model!r} has no chat template; use generate()")
        turns = []
        for j, turn in enumerate(conversation):
            if (
                not isinstance(turn, Mapping)
                or not isinstance(turn.get("content"), str)
                or not isinstance(turn.get("role"), str)
            ):
                raise ValueError(f"messages[{i}][{j}]: want {{'role': str, 'content': str}} (text only), got {turn!r}")
            turns.append((turn["role"], turn["content"]))
        try:
            text = template.render(turns)
        except LlmserveError as error:
            raise python_error(error) from error
        # The rendered conversation holds its special tokens already.
        return text, self._engine.tokenizer.encode(text, add_special_tokens=False)

    def _run(
        self, prompts: list[tuple[str | None, list[int]]], params: Params, use_tqdm: bool, adapters: Adapters = None
    ) -> list[RequestOutput]:
        per_prompt = _per_prompt(params, len(prompts))
        names = self._adapter_names(adapters, len(prompts))
        requests = [
            dataclasses.replace(self._request(ids, p), adapter_id=name)
            for (_, ids), p, name in zip(prompts, per_prompt, names)
        ]
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(requests), desc="Processed prompts", unit="prompt", dynamic_ncols=True)
        try:
            # The bar is advanced from the engine's thread as each request finishes.
            pieces = self._engine.generate(requests, lambda _: bar.update(1) if bar is not None else None)
        finally:
            if bar is not None:
                bar.close()
        decode = self._engine.tokenizer.decode
        return [
            request_output(
                req.request_id,
                text,
                list(req.prompt_token_ids),
                got,
                stop_token_ids=frozenset(req.stop_token_ids),
                logprobs=p.logprobs is not None,
                prompt_logprobs=p.prompt_logprobs is not None,
                decode=lambda t: decode([t], skip_special_tokens=False),
            )
            for (text, _), req, p, got in zip(prompts, requests, per_prompt, pieces)
        ]

    def _adapter_names(self, adapters: Adapters, count: int) -> list[str]:
        """Each prompt's adapter name ("" = the base model), registering the LoRARequests the
        engine does not serve yet."""
        if adapters is None or isinstance(adapters, (LoRARequest, str)):
            given: list[LoRARequest | str | None] = [adapters] * count
        else:
            given = list(adapters)
            if len(given) != count:
                raise ValueError(f"lora_request: {len(given)} adapters for {count} prompts")
        known = set(self.list_loras())
        names = []
        for i, item in enumerate(given):
            if isinstance(item, LoRARequest):
                if item.lora_name not in known:
                    if not item.lora_path:
                        raise ValueError(
                            f"lora_request[{i}]: adapter {item.lora_name!r} is not served and has no lora_path"
                        )
                    self._engine.call(_load_adapter(self._engine, item.lora_name, item.lora_path))
                    known.add(item.lora_name)
                names.append(item.lora_name)
            elif item is None or isinstance(item, str):
                names.append(item or "")
            else:
                raise ValueError(f"lora_request[{i}]: want a LoRARequest, an adapter name or None, got {item!r}")
        return names

    def _request(self, prompt_token_ids: list[int], p: SamplingParams) -> GenerationRequest:
        """The engine's request for one prompt: vLLM's conventions turned into the native API's
        (where 0 means unset)."""
        if p.truncate_prompt_tokens is not None:
            prompt_token_ids = prompt_token_ids[-p.truncate_prompt_tokens :]
        seed = p.seed
        if seed is None and self._seeds is not None:
            seed = self._seeds.getrandbits(63)
        return GenerationRequest(
            request_id=str(next(self._ids)),
            privileged=True,  # the process that runs the engine is its operator
            prompt_token_ids=tuple(prompt_token_ids),
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=max(p.top_k, 0),
            seed=seed,
            max_tokens=p.max_tokens or 0,
            stop=p.stop_strings,
            stop_token_ids=tuple(p.stop_token_ids or ()),
            ignore_eos=p.ignore_eos,
            n=p.n,
            best_of=p.best_of or 0,
            min_p=p.min_p,
            repetition_penalty=p.repetition_penalty,
            presence_penalty=p.presence_penalty,
            frequency_penalty=p.frequency_penalty,
            logprobs=p.logprobs,
            prompt_logprobs=p.prompt_logprobs,
            logit_bias=tuple(sorted((p.logit_bias or {}).items())),
            min_tokens=p.min_tokens,
            include_stop_str_in_output=p.include_stop_str_in_output,
            skip_special_tokens=p.skip_special_tokens,
            structured_output=_structured_output(p.structured_outputs),
        )


def _structured_output(so: StructuredOutputsParams | None) -> StructuredOutput | None:
    """vLLM's StructuredOutputsParams as the engine's (the native API's `structured_output`)."""
    if so is None:
        return None
    field = "structured_outputs"
    if so.json is not None:
        return StructuredOutput("json_schema", so.schema_text, field=field)
    if so.choice is not None:
        return StructuredOutput("choice", choices=tuple(so.choice), field=field)
    if so.regex is not None:
        return StructuredOutput("regex", so.regex, field=field)
    if so.grammar is not None:
        return StructuredOutput("grammar", so.grammar, field=field)
    return StructuredOutput("json_object", field=field)


def _per_prompt(params: Params, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    listed = list(params)
    if len(listed) != count:
        raise ValueError(f"sampling_params: {len(listed)} given for {count} prompts; give one, or one per prompt")
    for i, p in enumerate(listed):
        if not isinstance(p, SamplingParams):
            raise TypeError(f"sampling_params[{i}]: want SamplingParams, got {type(p).__name__}")
    return listed


async def _load_adapter(engine: LocalEngine, name: str, path: str) -> None:
    """On the engine's loop, which owns the adapter registry."""
    engine.engine.load_adapter(name, path)
