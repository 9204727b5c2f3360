"""Hugging Face interop: sharded safetensors I/O (`io`), per-model state-dict adapters
(`llama3`, `deepseek_v3`, `qwen3`; routed experts' layout: `experts`), and the `plait-convert` command line (`convert`).

An adapter is a module with four functions; `adapter.HFAdapter` spells out the interface.
Nothing is imported here so that one model's adapter missing or broken never hides another's.
"""
