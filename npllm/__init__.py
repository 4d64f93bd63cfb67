"""npllm: a readable NumPy Llama inference engine.

    >>> import npllm
    >>> llm = npllm.load("stories260K")
    >>> llm.generate("Lily and Ben", max_new_tokens=20, temperature=0)
"""

from .config import ModelConfig
from .constraint import Constraint
from .errors import NpllmError
from .llm import LLM, load
from .sampling import SamplingParams

__all__ = ["load", "LLM", "ModelConfig", "SamplingParams", "Constraint", "NpllmError"]
__version__ = "0.1.0"
