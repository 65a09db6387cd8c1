"""Integrations with trainers built on Accelerate: the Hugging Face Trainer and any subclass (TRL)."""
