"""Rollout engines (vllm: CUDA or CPU build; hf: transformers.generate)."""
