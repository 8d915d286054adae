"""vlft: fine-tune vision-language models with adapters, on any accelerator."""

__version__ = "0.1.0"
