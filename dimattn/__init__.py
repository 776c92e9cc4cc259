"""How many dimensions attention needs: DAR, sliding-window attention and DimPO."""

from transformers import AutoConfig, AutoModelForCausalLM

from .configuration_dimattn import DimAttnConfig
from .modeling_dimattn import DimAttnForCausalLM

# In-process registration; saved directories also carry auto_map for trust_remote_code.
AutoConfig.register(DimAttnConfig.model_type, DimAttnConfig, exist_ok=True)
AutoModelForCausalLM.register(DimAttnConfig, DimAttnForCausalLM, exist_ok=True)

__all__ = ["DimAttnConfig", "DimAttnForCausalLM"]
