"""Generation engines: the interface and registry (`base`), and each kind in its own module.
Importing the package registers every kind, so `make_engine("vllm", ...)` finds its class; the
concrete modules import vLLM itself only when an engine of theirs is built."""

from inference.engines.adapters import AdapterView, is_adapter_folder
from inference.engines.base import (
    Completion,
    Engine,
    EngineFactory,
    FinishReason,
    Prompts,
    SamplingParams,
    WeightsSource,
    make_engine,
    new_event_loop,
    read_state_dict,
    register_engine,
)
from inference.engines.patches import patch_cpu_moe_reload
from inference.engines.torch_engine import TorchEngine, processed_logits
from inference.engines.vllm import VLLMEngine
from inference.engines.vllm_async import AsyncVLLMEngine

__all__ = [
    "AdapterView",
    "AsyncVLLMEngine",
    "Completion",
    "Engine",
    "EngineFactory",
    "FinishReason",
    "Prompts",
    "SamplingParams",
    "TorchEngine",
    "VLLMEngine",
    "WeightsSource",
    "make_engine",
    "new_event_loop",
    "patch_cpu_moe_reload",
    "processed_logits",
    "read_state_dict",
    "is_adapter_folder",
    "register_engine",
]
