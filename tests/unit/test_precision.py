from pathlib import Path

import pytest
import torch

from dimattn.pretraining import precision
from dimattn.pretraining.precision import autocast, bf16_supported, resolve_precision


@pytest.mark.parametrize("flags,native", [
    ({"fpu", "avx512f", "avx512_bf16"}, True),  # Zen 4, Cooper Lake
    ({"fpu", "avx512f", "amx_bf16", "amx_tile"}, True),  # Sapphire Rapids
    ({"fpu", "avx2", "avx512f"}, False),
    (set(), False),  # no /proc/cpuinfo (macOS) or no flags line (ARM)
])
def test_auto_precision_takes_bf16_where_the_cpu_has_it(monkeypatch, flags, native):
    monkeypatch.setattr(precision, "_cpu_flags", lambda: flags)
    assert bf16_supported("cpu") is native
    assert resolve_precision("auto", "cpu") == ("bf16" if native else "fp32")
    assert resolve_precision("auto", torch.device("cpu")) == ("bf16" if native else "fp32")
    assert resolve_precision("fp32", "cpu") == "fp32" and resolve_precision("bf16", "cpu") == "bf16"


def test_auto_precision_on_cuda_and_other_devices(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not bf16_supported("cuda") and resolve_precision("auto", "cuda") == "fp32"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: not including_emulation)
    assert bf16_supported("cuda:0") and resolve_precision("auto", "cuda") == "bf16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    assert not bf16_supported("cuda")  # emulated bf16 (pre-Ampere) is no faster: fp32
    assert not bf16_supported("meta")


def test_cpu_flags_parse_proc_cpuinfo():
    flags = precision._cpu_flags()
    assert isinstance(flags, set)
    if Path("/proc/cpuinfo").exists() and "flags" in Path("/proc/cpuinfo").read_text():
        assert "fpu" in flags


def test_autocast_follows_the_resolved_precision(monkeypatch):
    x = torch.randn(4, 8)
    with autocast("cpu", "bf16"):
        assert (x @ x.T).dtype == torch.bfloat16
    with autocast("cpu", "fp32"):
        assert (x @ x.T).dtype == torch.float32
    monkeypatch.setattr(precision, "_cpu_flags", lambda: set())
    with autocast("cpu", "auto"):
        assert (x @ x.T).dtype == torch.float32
    monkeypatch.setattr(precision, "_cpu_flags", lambda: {"amx_bf16"})
    with autocast("cpu", "auto"):
        assert (x @ x.T).dtype == torch.bfloat16


def test_unknown_precision_is_refused_by_name():
    with pytest.raises(ValueError, match=r"precision must be one of .*'fp16'"):
        resolve_precision("fp16", "cpu")
