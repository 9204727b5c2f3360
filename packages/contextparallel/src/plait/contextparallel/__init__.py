"""plait.contextparallel: Context parallel: ring attention (all-gather and all-to-all rotation), load balancing, all-to-all (head) CP."""

__version__ = "0.1.0"
