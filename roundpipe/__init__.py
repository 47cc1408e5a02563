"""roundpipe: fast CPU optimizers that are drop-in replacements for torch.optim."""

__version__ = "0.1.0"
