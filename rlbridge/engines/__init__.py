"""Trainer engines (hf: transformers + peft; megatron: Megatron-core through Megatron-Bridge/mbridge)."""
