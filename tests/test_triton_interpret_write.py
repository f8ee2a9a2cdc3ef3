"""The Triton write path under the Triton interpreter on the CPU (tiny config): same bytes as the torch backend.

Checks the kernels' logic (slot sources, tails, previous-window rotation, page addressing, byte layouts, the
quantizers' bit arithmetic) without a GPU. The kernels reproduce torch's *CUDA* reduction orders; on the CPU
torch sums in other orders, which could in principle differ in the last bit — these small cases agree exactly.
Skipped when triton is not installed. The GPU tests (test_gpu_write_path.py) check bit-exactness on CUDA.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

_SCRIPT = r"""
import sys, torch, dsv4
from dsv4.layer import Attention
from dsv4.ops import torch_ops, triton_write
from write_path_util import differences, make_cache, write_step
cfg = dsv4.ModelConfig.preset("tiny")
li = int(sys.argv[1])
lay = Attention(dsv4.AttentionWeights.random(cfg, li, seed=1), cfg, li, backend="torch")
ca, cb = make_cache(cfg, [li], "cpu", 4), make_cache(cfg, [li], "cpu", 4)
for r in "abc":
    ca.add_request(r); cb.add_request(r)
g = torch.Generator().manual_seed(li)
plans = [{"a": 37, "b": 5}, {"a": 3, "b": 1, "c": 18}, {"a": 1, "b": 1, "c": 1}, {"b": 11, "c": 2}]
for step, plan in enumerate(plans):
    ba, bb = ca.prepare_forward(plan), cb.prepare_forward(plan)
    x = torch.randn(ba.num_tokens, cfg.hidden_size, generator=g)
    k1, k2 = write_step(torch_ops, lay, ca, ba, x), write_step(triton_write, lay, cb, bb, x)
    nk = int((k1.view(torch.int16) != k2.view(torch.int16)).sum())
    d = differences(ca, cb, li)
    assert nk == 0 and not d, (li, step, nk, d)
print("OK")
"""


@pytest.mark.parametrize("li", [0, 1, 2], ids=["swa", "csa", "hca16"])
def test_interpreted_write_path_matches_torch(li: int) -> None:
    here = os.path.dirname(__file__)
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([os.path.join(here, "..", "src"), here, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", _SCRIPT, str(li)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]
