"""The flashserve engine: paged V4 / V4.1 state, continuous batching, chunked and encoder-only prefill,
prefix caching, sampling and the offline API."""

from .llm import LLM
from .llm_engine import EngineConfig, LLMEngine
from .sampling_params import QueueFullError, RequestError, SamplingParams
from .sequence import CompletionOutput, RequestOutput
from .tokenizer import Tokenizer, load_tokenizer

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineConfig",
           "QueueFullError", "RequestError", "Tokenizer", "load_tokenizer"]
