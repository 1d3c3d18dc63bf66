"""The DeepSeek-V4 / V4.1 model in PyTorch: reference forward, state protocol, quantisation, checkpoints."""

from .loader import load_model
from .state import DenseState, SequenceState
from .transformer import ForwardOutput, Transformer

__all__ = ["load_model", "DenseState", "SequenceState", "ForwardOutput", "Transformer"]
