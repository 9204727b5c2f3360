"""plait.expertparallel: not implemented yet; see the package README."""

__version__ = "0.1.0"
