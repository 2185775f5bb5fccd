"""The gpt2 family: nanoGPT's GPT (pre-norm blocks, learned positions, GELU MLP, tied
embeddings), read from and written as transformers' GPT2LMHeadModel. Torch-free: the config
section; the module is ``model.py``."""

from stoker.families.gpt2.config import GPT2Config as Config

__all__ = ["Config"]
