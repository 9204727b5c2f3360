"""plait.expertparallel: dp2ep expert parallel: expert sharding, all-to-all dispatch/combine, expert-tensor parallel."""

__version__ = "0.1.0"
