"""What travels from the trainer to the rollout, named once for both sides (and for export-hf)."""

from __future__ import annotations

from typing import Literal

WeightSync = Literal["merged", "adapter"]
"""rollout.weight_sync, a WeightExport's kind, export-hf's choice: every weight of the HF model with the adapters
folded in (merged), or the PEFT adapter's lora_A / lora_B tensors alone (adapter)."""
