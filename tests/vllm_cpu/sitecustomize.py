"""Imported at start-up by every Python process of the vLLM servers the tests start (this folder
is on their PYTHONPATH, for planted.py): keeps vLLM's CPU attention off its AMX kernels.

vLLM 0.32's CPU attention picks its "amx" kernels when ``torch.cpu._is_amx_tile_supported()``
says so (CPUID), for bfloat16 with blocks of a multiple of 32. On virtual machines whose CPU
advertises AMX without the hypervisor enabling it (measured: a 2-core "Intel Xeon Processor"
guest), the worker dies of SIGILL in ``cpu_attention_with_kv_cache`` on the first request, and
every completion is a 500. Without AMX the same kernels take the AVX-512 / AVX2 "vec" path,
the one AMD machines take anyway: every machine then runs the same attention code.
Set FUZZ_VLLM_ALLOW_AMX=1 to leave vLLM's choice alone.

The patch is applied when ``torch.cpu`` is first imported, not by importing torch here: every
Python process on this PYTHONPATH runs this file, and the server's worker starts many that never
import torch (torch inductor checks each kernel it loads in a ``python -c`` subprocess, during
serving). Importing torch in each took 1.3 s of CPU: on 2 cores the worker's step waited for it
and the fuzzer's own event loop was starved of CPU for up to seconds (benchmarks/README.md,
"Real server: vLLM").
"""

import importlib.abc
import importlib.machinery
import os
import sys


class _AmxOff(importlib.abc.MetaPathFinder):
    """Finds ``torch.cpu`` as the path finder would, and patches the module once it has run."""

    def find_spec(self, name, path, target=None):
        if name != "torch.cpu":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module._is_amx_tile_supported = lambda: False

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("FUZZ_VLLM_ALLOW_AMX") != "1":
    sys.meta_path.insert(0, _AmxOff())
