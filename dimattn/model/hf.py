"""transformers glue shared by the capture (dimattn.dimpo.capture) and the projected models
(dimattn.model.modeling_projected, whose directories carry a copy of this module): imports only
transformers' config files and the standard library.
"""

import json
from pathlib import Path


def switch_attention(model, implementation):
    """``set_attn_implementation``, or the config attribute where the model class refuses it.

    transformers only lets a class switch if its modeling source contains the text
    ``ALL_ATTENTION_FUNCTIONS.get_interface(``; for any other class the call only logs a
    warning. Setting the config attribute is what the call does once its checks pass.
    """
    if type(model)._can_set_attn_implementation():
        model.set_attn_implementation(implementation)
    if model.config._attn_implementation != implementation:
        model.config._attn_implementation = implementation


def is_dimattn_directory(source) -> bool:
    """Whether ``source`` is one of our own run directories (model_type "dimattn"): the only
    models loaded with remote code, which is then our own."""
    config = Path(str(source)) / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("model_type") == "dimattn"
