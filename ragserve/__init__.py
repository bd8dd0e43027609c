"""ragserve: an LLM serving engine for long documents."""

from ragserve.config import EngineConfig
from ragserve.llm import LLM
from ragserve.outputs import CompletionOutput, Logprob, RequestOutput
from ragserve.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "EngineConfig", "Logprob", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
