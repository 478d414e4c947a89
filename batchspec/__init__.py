"""batchspec: exact batch speculative decoding for Hugging Face causal language models."""

from .config import METHODS, EngineConfig
from .core.request import Output, RequestStats, StepOutput
from .engine import SpecEngine
from .models import ModelPair, load_pair
from .sampling import SamplingParams

__version__ = "0.1.0"

__all__ = ["METHODS", "EngineConfig", "ModelPair", "Output", "RequestStats", "SamplingParams", "SpecEngine",
           "StepOutput", "load_pair", "__version__"]
