"""plait.tensorparallel: Tensor parallel, sequence parallel and loss parallel from a model's plan strings."""

__version__ = "0.1.0"
