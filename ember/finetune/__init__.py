"""Fine-tuning transforms applied to a model from outside: lora.py (LoRA adapters, peft import/export)."""
