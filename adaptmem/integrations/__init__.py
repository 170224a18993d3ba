"""Thin adapters that let frameworks drive a `MemoryManager`: one module per framework.

  lightning.py     AdaptMemCallback for a Lightning Trainer
  transformers.py  AdaptMemTrainerCallback (and AdaptMemTrainerMixin) for a Hugging Face Trainer

The core never imports them (an import-linter contract); each imports its framework.
"""
