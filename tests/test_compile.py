"""Every Triton kernel variant compiles for sm_80 and sm_90 (no GPU needed); the assert
variants' PTX calls __assertfail and the others' does not; from the same compile (ptxas -v and
the PTX): 0 bytes of spill and at most 64 registers per thread, and the copy variants' global
loads and stores are 16-byte (`.v4`). The CUDA kernels get the same checks in test_static_gpu.py."""
import json
import os
import subprocess
import sys

import pytest

from kvwrite.kernels.compile_check import CHECKS, FAMILIES


# Variants allowed more than 64 registers, and why. Spills stay 0. (compile_check compiles each
# variant with a launch's own specialisation: defaulted constexprs, int32 scalars, divisibility.)
# store_dsv4: the fp16 page-granular DCP variant on sm_80 needs 72 (82 in guard mode, which
#   also counts the program for the record's call epoch).
# store_mla: fp32 input with loc_map + DCP: the row copy 66 on sm_80 (its 4 warps: 8 spill),
#   70-72 in guard mode; fp8_ds_mla with loc_map + DCP in guard mode up to 84. Seen once the
#   static compile used a launch's int32 scalars; not yet re-tuned.
# rope_store: a rotated element keeps its pair partner, cos, sin and norm weight live (up to ~111
#   on sm_90 for the two-pass per-token int8 and the MLA row programs); not yet tuned.
REGISTER_LIMIT = {"store_dsv4": 88, "store_mla": 88, "rope_store": 128}
# Copy variants whose stores are strided, not 16-byte: vLLM's legacy head-major layout (its V
# cache is [.., D, block]: consecutive features of a token are a block apart). Loads stay .v4.
STRIDED_STORE = ("+head_major",)
# Variants known to spill, named with their bound (to be tuned, not hidden): rope_store's int8
# K/V with GPT-J rotation and q/k norm spills 16 bytes on sm_90 in its off variant.
KNOWN_SPILL = {("rope_store", "->int8/"): 16}


def _known_spill(family: str, variant: str) -> int:
    return max([n for (f, part), n in KNOWN_SPILL.items() if f == family and part in variant], default=0)


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("family", FAMILIES)
def test_every_variant_compiles_for_sm80_and_sm90(family, check):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "kvwrite.kernels.compile_check", "--family", family,
                          "--check", check, "--cc", "80", "90"], env=env, capture_output=True,
                         text=True, timeout=900)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    failed = [r for r in rows if not r["ok"]]
    assert not failed, failed[:3]
    assert out.returncode == 0, out.stderr[-3000:]
    assert rows and {r["cc"] for r in rows} == {80, 90}
    assert all(r["assertfail"] == (check == "assert") for r in rows), rows
    over = [(r["variant"], r["cc"], r["regs"], r["spill"]) for r in rows
            if r["spill"] > _known_spill(family, r["variant"]) or r["regs"] > REGISTER_LIMIT.get(family, 64)]
    assert not over, over
    scalar = [(r["variant"], r["cc"], r["v4_ld"], r["v4_st"]) for r in rows
              if r["copy"] and not (r["v4_ld"] and (r["v4_st"] or r["variant"].endswith(STRIDED_STORE)))]
    assert not scalar, scalar
