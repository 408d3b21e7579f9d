"""Peak memory of a GPT-2-small generation, measured in a fresh process."""

import json
import os
import subprocess
import sys

import pytest

from cyformer.kv_cache import PAD

# VmHWM, not getrusage's ru_maxrss: Linux carries ru_maxrss across fork+exec,
# so a child of this (large) pytest process would report the parent's peak.
PROBE = r"""
import json, sys
import cyformer

def vm_hwm_mb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024

path = sys.argv[1]
m = cyformer.load(path, threads=2)
object.__setattr__(m.config, "eos_token_id", None)
out = m.generate(list(range(16)), max_new_tokens=64)
print(json.dumps({"peak_mb": vm_hwm_mb(),
                  "tokens": len(out)}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc for VmHWM")
def test_peak_rss_of_gpt2_small_generation(checkpoint):
    """Peak RSS <= weights + the KV cache + 100 MB (interpreter included); the
    cache holds the 16 + 64 positions this generation can reach (PAD included)."""
    path, _ = checkpoint("gpt2-small")
    r = subprocess.run([sys.executable, "-c", PROBE, path], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    weights_mb = os.path.getsize(os.path.join(path, "model.safetensors")) / 2 ** 20
    kv_mb = 2 * 12 * (16 + 64 + PAD) * 768 * 4 / 2 ** 20  # k and v, 12 layers, d_model 768
    limit = weights_mb + kv_mb + 100
    assert got["tokens"] == 64
    assert got["peak_mb"] <= limit, f"peak RSS {got['peak_mb']:.0f} MB > {limit:.0f} MB"
