"""infinity: train PyTorch models too large for the hardware they run on."""

__version__ = "0.1.0"
