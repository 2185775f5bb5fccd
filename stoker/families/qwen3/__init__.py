"""The qwen3 family: Qwen3's dense models (q/k RMSNorm per head, explicit head_dim, no q/k/v
bias, tied or untied), read from and written as transformers' Qwen3ForCausalLM. Built on the
llama family's folder: its config section, its module and its tensor-parallel plan extend
llama's. Torch-free: the config section; the module is ``model.py``, the plan ``parallel.py``."""

from stoker.families.qwen3.config import Qwen3Config as Config

__all__ = ["Config"]
