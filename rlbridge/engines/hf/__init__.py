"""The hf trainer engine: transformers + peft in one process, the embedded default on a machine without GPUs.

Importing this package imports nothing heavy (`spec` is read by recipe validation and `rlbridge plan`).
`HFTrainEngine` lives in `.engine`, PPO's critic in `.critic`, mixture-of-experts LoRA in `.moe`, the
float32 masters of a 16-bit model in `.master`, the one-pass log-probs in `.token_stats`, the shared-prompt
passes in `.shared_prompts` and the CUDA-graph passes in `.graphs`.
"""
