"""The planner's vocabulary: names shared by the plan (dimattn.workflow.sweeps), its checks
(dimattn.workflow.checks) and the stages that read plans, and the error every refusal raises
naming its config key. No torch, no imports beyond the standard library."""

from __future__ import annotations

import json


SYNTHETIC_SOURCES = {"synthetic_recall", "synthetic_longctx"}  # generated here: no text
LONGCTX_SOURCE = "synthetic_longctx"  # dimattn.data.longctx's RULER-style suite


# DimPO fits: Table 1's grid is the study "table1" at the setting "default" (dimpo.hparams as
# they are); dimpo.ablations adds studies whose settings apply over dimpo.hparams.
MAIN_STUDY = "table1"
DEFAULT_SETTING = "default"
CAPTURE_FIELDS = ("capture_dtype", "special_tokens")  # set per capture, so never per fit
# The objectives whose loss reads DimPO's top-k (dimattn.dimpo.objectives: "k" in Objective.hparams;
# tests/e2e/test_sweeps.py holds the two equal).
HEAD_OBJECTIVES = ("dimpo", "dimpo_list")


def setting_name(overrides: dict) -> str:
    """The name (and path component) of a fit setting: "default" for none, else
    "key=value,..." in the given order, values as JSON ("k=64,lam=0.5", "causal=true")."""
    if not overrides:
        return DEFAULT_SETTING
    return ",".join(
        f"{key}={value if isinstance(value, str) else json.dumps(value)}" for key, value in overrides.items()
    )


def parse_setting(name: str) -> dict:
    """The overrides of :func:`setting_name`'s ``name``."""
    if name == DEFAULT_SETTING:
        return {}
    out = {}
    for part in name.split(","):
        key, _, value = part.partition("=")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out



RULER_TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
               "niah_multikey_3", "niah_multiquery", "niah_multivalue", "ruler_vt", "ruler_cwe", "ruler_fwe",
               "ruler_qa_squad", "ruler_qa_hotpot")
RULER_MIN_LENGTH = 2048
# The lm-eval RULER task each subtask of our long-context suite (dimattn.data.longctx) stands for.
RULER_TASK = {"niah_single": "niah_single_1", "niah_multikey": "niah_multikey_1", "niah_multivalue": "niah_multivalue",
              "niah_multiquery": "niah_multiquery", "vt": "ruler_vt", "cwe": "ruler_cwe", "fwe": "ruler_fwe",
              "qa": "ruler_qa_squad"}
SUITE_SUBTASKS = tuple(RULER_TASK)  # the suite's subtasks, in dimattn.data.longctx.SUBTASKS' order
# Runs DimPO can project: vanilla, and DAR or uniform, whose far keys F projects too (both
# reductions composed, dimattn.model.modeling_projected); a sliding window drops keys F never sees.
PROJECTABLE = ("vanilla", "dar", "uniform")
BASE_OBJECTIVE = "base"  # the unprojected model (l = 0) among the downstream scores
NO_KV = "none"  # no KV-cache compression



class ConfigError(ValueError):
    def __init__(self, key: str, message: str):
        super().__init__(f"config key {key}: {message}")
        self.key = key
