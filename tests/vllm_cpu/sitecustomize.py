"""Imported at start-up by every Python process of the vLLM servers the tests start (this folder
is on their PYTHONPATH, for planted.py): keeps vLLM's CPU attention off its AMX kernels.

vLLM 0.32's CPU attention picks its "amx" kernels when ``torch.cpu._is_amx_tile_supported()``
says so (CPUID), for bfloat16 with blocks of a multiple of 32. On virtual machines whose CPU
advertises AMX without the hypervisor enabling it (measured: a 2-core "Intel Xeon Processor"
guest), the worker dies of SIGILL in ``cpu_attention_with_kv_cache`` on the first request, and
every completion is a 500. Without AMX the same kernels take the AVX-512 / AVX2 "vec" path,
the one AMD machines take anyway: every machine then runs the same attention code.
Set FUZZ_VLLM_ALLOW_AMX=1 to leave vLLM's choice alone.
"""

import os

if os.environ.get("FUZZ_VLLM_ALLOW_AMX") != "1":
    try:
        import torch.cpu
    except ImportError:  # make_model.py's imports, or a python without torch: nothing to keep off
        pass
    else:
        torch.cpu._is_amx_tile_supported = lambda: False
