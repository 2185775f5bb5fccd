"""The qwen3_moe family: Qwen3's mixtures (Qwen3-30B-A3B, 235B-A22B): Qwen3's attention with
q/k norms, sparse layers of top-k SwiGLU experts (``norm_topk_prob`` renormalizes the top-k
weights or not), dense layers among them where ``mlp_only_layers`` or ``decoder_sparse_step``
say; read from and written as transformers' Qwen3MoeForCausalLM. Built on the qwen3 and
mixtral families' folders. Torch-free: the config section; the module is ``model.py``."""

from stoker.families.qwen3_moe.config import Qwen3MoeConfig as Config

__all__ = ["Config"]
