"""LoRA adapters in mixed batches: the bank, stacked weights, experts, folder formats."""
