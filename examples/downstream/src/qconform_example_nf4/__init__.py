"""An example downstream backend: bitsandbytes' 4-bit layout in plain PyTorch."""

from qconform_example_nf4.backend import TorchNF4Backend

__all__ = ["TorchNF4Backend"]
