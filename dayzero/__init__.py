"""dayzero: bring up ultra-large sparse MoE models on day 0, then serve them fast."""
from dayzero.engine.llm import LLM
from dayzero.engine.request import CompletionOutput, RequestOutput
from dayzero.engine.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
