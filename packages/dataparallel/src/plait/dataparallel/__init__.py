"""plait.dataparallel: FSDP2, HSDP, DDP and the FSDP-based replicate, with mixed precision by policy."""

__version__ = "0.1.0"
