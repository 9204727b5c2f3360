"""plait-plan: per-rank memory, communication and step time of a layout, traced before any
hardware is rented (rank 0 of the real parallelize path under a fake process group)."""

__version__ = "0.1.0"
