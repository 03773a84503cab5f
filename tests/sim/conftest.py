"""Shared runs for the simulator tests: the calibration rows and a modern Llama/H100 base."""

from __future__ import annotations

import pytest

from myria.sim import runspec

LLAMA_70B_H100 = """
name = "llama70b-h100"
[model]
arch = "llama"
layers = 80
hidden = 8192
heads = 64
kv_heads = 8
ffn_hidden = 28672
vocab = 32000
seq_len = 4096
[training]
global_batch = 1024
micro_batch = 1
recompute = "selective"
zero_stage = 1
[parallel]
tp = 8
pp = 4
vpp = 5
sequence_parallel = true
schedule = "interleaved-1f1b"
[overlap]
tp = false
pp = true
dp = true
[kernels]
flash_attention = true
[cluster]
gpu = "h100-sxm-80gb"
gpus = 1024
"""


@pytest.fixture(scope="session")
def calibration():
    return runspec.load_calibration()


@pytest.fixture(scope="session")
def llama():
    return runspec.loads(LLAMA_70B_H100)[0]


@pytest.fixture(scope="session")
def gpt39(calibration):
    """Megatron-LM 2021 39.1B row: tp 8, pp 2, interleaved, full recompute, no overlap."""
    return next(r for r in calibration if r.name.endswith("39.1b"))
