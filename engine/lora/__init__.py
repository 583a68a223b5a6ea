"""LoRA adapters on one base model: loading PEFT folders, and their deltas in a step
whose rows belong to different adapters (docs/lora.md)."""
