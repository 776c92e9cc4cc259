"""How many dimensions attention needs: DAR, sliding-window attention and DimPO.

Submodules are imported on demand so that light stages (reporting) need no torch.
"""

__all__ = ["DimAttnConfig", "DimAttnForCausalLM"]


def __getattr__(name):
    if name in __all__:
        from transformers import AutoConfig, AutoModelForCausalLM

        from dimattn.model.configuration_dimattn import DimAttnConfig
        from dimattn.model.modeling_dimattn import DimAttnForCausalLM

        # In-process registration; saved directories also carry auto_map for trust_remote_code.
        AutoConfig.register(DimAttnConfig.model_type, DimAttnConfig, exist_ok=True)
        AutoModelForCausalLM.register(DimAttnConfig, DimAttnForCausalLM, exist_ok=True)
        return {"DimAttnConfig": DimAttnConfig, "DimAttnForCausalLM": DimAttnForCausalLM}[name]
    raise AttributeError(f"module 'dimattn' has no attribute {name!r}")
