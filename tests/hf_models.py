"""Tiny random `transformers` models for tests: see `lmforge.model.reference`."""

from lmforge.model.reference import LLAMA3_ROPE, VARIANTS, hf_config, make_hf_model, save_hf_model

__all__ = ["LLAMA3_ROPE", "VARIANTS", "hf_config", "make_hf_model", "save_hf_model"]
