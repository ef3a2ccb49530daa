from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerInfo(_message.Message):
    __slots__ = ("model_name", "vocab_size", "max_model_len", "dtype", "device", "rank", "world_size", "block_size", "num_gpu_blocks", "num_cpu_blocks", "block_bytes", "max_loras", "max_lora_rank", "pipeline_stages", "draft_model")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_GPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_STAGES_FIELD_NUMBER: _ClassVar[int]
    DRAFT_MODEL_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    vocab_size: int
    max_model_len: int
    dtype: str
    device: str
    rank: int
    world_size: int
    block_size: int
    num_gpu_blocks: int
    num_cpu_blocks: int
    block_bytes: int
    max_loras: int
    max_lora_rank: int
    pipeline_stages: int
    draft_model: str
    def __init__(self, model_name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., block_size: _Optional[int] = ..., num_gpu_blocks: _Optional[int] = ..., num_cpu_blocks: _Optional[int] = ..., block_bytes: _Optional[int] = ..., max_loras: _Optional[int] = ..., max_lora_rank: _Optional[int] = ..., pipeline_stages: _Optional[int] = ..., draft_model: _Optional[str] = ...) -> None: ...

class AdapterLoad(_message.Message):
    __slots__ = ("slot", "name", "path", "version")
    SLOT_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    slot: int
    name: str
    path: str
    version: int
    def __init__(self, slot: _Optional[int] = ..., name: _Optional[str] = ..., path: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class SamplingBatch(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "output_position", "num_logprobs", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "bias_offsets", "bias_token_ids", "bias_values", "history_offsets", "history_token_ids", "prompt_logprobs", "prompt_next_token", "mask_rows", "token_masks", "token_mask_words", "mask_sparse", "mask_id_offsets", "mask_token_ids")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_POSITION_FIELD_NUMBER: _ClassVar[int]
    NUM_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    BIAS_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    BIAS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BIAS_VALUES_FIELD_NUMBER: _ClassVar[int]
    HISTORY_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_NEXT_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MASK_ROWS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_MASKS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_MASK_WORDS_FIELD_NUMBER: _ClassVar[int]
    MASK_SPARSE_FIELD_NUMBER: _ClassVar[int]
    MASK_ID_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    MASK_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    temperature: bytes
    top_p: bytes
    top_k: bytes
    seed: bytes
    output_position: bytes
    num_logprobs: bytes
    min_p: bytes
    repetition_penalty: bytes
    presence_penalty: bytes
    frequency_penalty: bytes
    bias_offsets: bytes
    bias_token_ids: bytes
    bias_values: bytes
    history_offsets: bytes
    history_token_ids: bytes
    prompt_logprobs: bytes
    prompt_next_token: bytes
    mask_rows: bytes
    token_masks: bytes
    token_mask_words: int
    mask_sparse: bytes
    mask_id_offsets: bytes
    mask_token_ids: bytes
    def __init__(self, temperature: _Optional[bytes] = ..., top_p: _Optional[bytes] = ..., top_k: _Optional[bytes] = ..., seed: _Optional[bytes] = ..., output_position: _Optional[bytes] = ..., num_logprobs: _Optional[bytes] = ..., min_p: _Optional[bytes] = ..., repetition_penalty: _Optional[bytes] = ..., presence_penalty: _Optional[bytes] = ..., frequency_penalty: _Optional[bytes] = ..., bias_offsets: _Optional[bytes] = ..., bias_token_ids: _Optional[bytes] = ..., bias_values: _Optional[bytes] = ..., history_offsets: _Optional[bytes] = ..., history_token_ids: _Optional[bytes] = ..., prompt_logprobs: _Optional[bytes] = ..., prompt_next_token: _Optional[bytes] = ..., mask_rows: _Optional[bytes] = ..., token_masks: _Optional[bytes] = ..., token_mask_words: _Optional[int] = ..., mask_sparse: _Optional[bytes] = ..., mask_id_offsets: _Optional[bytes] = ..., mask_token_ids: _Optional[bytes] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "seq_ids", "query_lens", "context_lens", "input_ids", "block_ids", "block_offsets", "sample", "sampling", "swap_out", "swap_in", "copy", "adapter_loads", "lora_slots", "draft_lens", "propose_lens")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    QUERY_LENS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENS_FIELD_NUMBER: _ClassVar[int]
    INPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SWAP_OUT_FIELD_NUMBER: _ClassVar[int]
    SWAP_IN_FIELD_NUMBER: _ClassVar[int]
    COPY_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_LOADS_FIELD_NUMBER: _ClassVar[int]
    LORA_SLOTS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LENS_FIELD_NUMBER: _ClassVar[int]
    PROPOSE_LENS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    seq_ids: bytes
    query_lens: bytes
    context_lens: bytes
    input_ids: bytes
    block_ids: bytes
    block_offsets: bytes
    sample: bytes
    sampling: SamplingBatch
    swap_out: bytes
    swap_in: bytes
    copy: bytes
    adapter_loads: _containers.RepeatedCompositeFieldContainer[AdapterLoad]
    lora_slots: bytes
    draft_lens: bytes
    propose_lens: bytes
    def __init__(self, step_id: _Optional[int] = ..., seq_ids: _Optional[bytes] = ..., query_lens: _Optional[bytes] = ..., context_lens: _Optional[bytes] = ..., input_ids: _Optional[bytes] = ..., block_ids: _Optional[bytes] = ..., block_offsets: _Optional[bytes] = ..., sample: _Optional[bytes] = ..., sampling: _Optional[_Union[SamplingBatch, _Mapping]] = ..., swap_out: _Optional[bytes] = ..., swap_in: _Optional[bytes] = ..., copy: _Optional[bytes] = ..., adapter_loads: _Optional[_Iterable[_Union[AdapterLoad, _Mapping]]] = ..., lora_slots: _Optional[bytes] = ..., draft_lens: _Optional[bytes] = ..., propose_lens: _Optional[bytes] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "sampled_token_ids", "execute_seconds", "logprobs", "top_token_ids", "top_logprobs", "top_width", "prompt_offsets", "prompt_logprobs", "prompt_top_token_ids", "prompt_top_logprobs", "prompt_top_width", "part_seconds", "num_accepted", "draft_logprobs", "draft_proposals")
    class PartSecondsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EXECUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_WIDTH_FIELD_NUMBER: _ClassVar[int]
    PROMPT_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_WIDTH_FIELD_NUMBER: _ClassVar[int]
    PART_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PROPOSALS_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    sampled_token_ids: bytes
    execute_seconds: float
    logprobs: bytes
    top_token_ids: bytes
    top_logprobs: bytes
    top_width: int
    prompt_offsets: bytes
    prompt_logprobs: bytes
    prompt_top_token_ids: bytes
    prompt_top_logprobs: bytes
    prompt_top_width: int
    part_seconds: _containers.ScalarMap[str, float]
    num_accepted: bytes
    draft_logprobs: bytes
    draft_proposals: bytes
    def __init__(self, step_id: _Optional[int] = ..., sampled_token_ids: _Optional[bytes] = ..., execute_seconds: _Optional[float] = ..., logprobs: _Optional[bytes] = ..., top_token_ids: _Optional[bytes] = ..., top_logprobs: _Optional[bytes] = ..., top_width: _Optional[int] = ..., prompt_offsets: _Optional[bytes] = ..., prompt_logprobs: _Optional[bytes] = ..., prompt_top_token_ids: _Optional[bytes] = ..., prompt_top_logprobs: _Optional[bytes] = ..., prompt_top_width: _Optional[int] = ..., part_seconds: _Optional[_Mapping[str, float]] = ..., num_accepted: _Optional[bytes] = ..., draft_logprobs: _Optional[bytes] = ..., draft_proposals: _Optional[bytes] = ...) -> None: ...
