"""The mixtral family: Mixtral's sparse mixtures (Llama's attention, every layer's MLP a top-k
mixture of SwiGLU experts, renormalized top-k weights), read from and written as transformers'
MixtralForCausalLM. Built on the llama family's folder and the shared mixture pieces
(``families.moe``, ``families.moe_section``). Torch-free: the config section; the module is
``model.py``."""

from stoker.families.mixtral.config import MixtralConfig as Config

__all__ = ["Config"]
