"""The learner's allocator setting (``common.lifecycle.tune_allocator``), in fresh processes."""
from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

PROBE = r"""
import resource, sys, torch
from common.lifecycle import tune_allocator
applied = tune_allocator() if sys.argv[1] == "tune" else False
n = 1 << 22                        # 16 MiB of float32: one fragment of a 10^8-parameter model
def merge():                       # three fragment-sized temporaries at once, as a merge applied by carry
    new_base = torch.empty(n); new_base.fill_(1.0)
    local = torch.empty(n); local.fill_(2.0)
    carried = torch.empty(n); carried.fill_(3.0)
    return float(new_base[0] + local[0] + carried[0])
for _ in range(20):                # settled: glibc's own thresholds adapt over the first frees
    merge()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    merge()
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str, **env: str) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True,
                         env={**{k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"},
                              "PYTHONPATH": os.getcwd(), **env})
    applied, faults = out.stdout.split()
    return applied == "True", int(faults)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_tuned_allocator_reuses_fragment_sized_blocks_instead_of_faulting_them_in_again():
    applied, tuned = _faults("tune")
    _, plain = _faults("plain")
    assert applied
    pages = 10 * (1 << 22) * 4 // 4096                # one temporary's pages, once per merge
    # at most a few blocks faulted back in over the 10 merges, not one temporary per merge (one run
    # under two pytest workers faulted 8,192 pages back: two 16 MiB blocks, once)
    assert tuned <= pages // 4, (tuned, plain, pages)
    # with glibc's defaults (2.36 here) the same loop mostly faults 12-16 k pages back in, but not
    # in every run (it depends on where the heap's blocks fall), so that side is not asserted


def test_an_operators_choice_or_the_opt_out_is_left_alone():
    assert _faults("tune", DDLOCO_MALLOC="default")[0] is False
    assert _faults("tune", MALLOC_TRIM_THRESHOLD_="1048576")[0] is False
    assert _faults("tune", GLIBC_TUNABLES="glibc.malloc.trim_threshold=1048576")[0] is False
