"""The llama family: Llama 2/3/3.1/3.2, Mistral and Qwen2/2.5 (RMSNorm, RoPE, grouped-query
attention, SwiGLU), read from and written as transformers' LlamaForCausalLM, MistralForCausalLM
and Qwen2ForCausalLM. Torch-free: the config section; the module is ``model.py``, the
tensor-parallel plan ``parallel.py``."""

from stoker.families.llama.config import LlamaConfig as Config

__all__ = ["Config"]
