"""plait.trainer: The thin composer and the plait-train CLI."""

__version__ = "0.1.0"
