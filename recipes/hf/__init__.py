"""Hugging Face interop: the HF config, the weight-name mapping and reading/writing HF checkpoints."""
