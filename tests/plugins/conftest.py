"""Fixtures of the plugin tests: the ``plugins/mla_decode`` modules, and the Triton kernel compiled for the GPU
or, without one, run by Triton's CPU interpreter.

``TRITON_INTERPRET=1`` must be set before ``triton`` is first imported (Triton's own ``tl.max``, ``tl.cdiv``...
are ``@triton.jit`` functions made at import) and stay set while kernels run; ``torch._dynamo`` imports
``triton`` as soon as it loads (a custom op call, an export). So it is set here, when pytest loads this
conftest during collection, before any test runs; nothing else in the suite runs Triton kernels.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

from mla_deploy.trt.plugin_loader import load_plugin_module

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None

if HAS_TRITON and not HAS_CUDA and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session")
def reference():
    """``plugins/mla_decode/reference.py``."""
    return load_plugin_module("reference")


@pytest.fixture(scope="session")
def kernel():
    """``plugins/mla_decode/triton_kernel.py``: compiled for the GPU, or interpreted on the CPU when there is none."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed (pip install triton): the kernel tests need it")
    if not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU, and triton was imported before its interpreter could be switched on")
    return load_plugin_module("triton_kernel")


@pytest.fixture(scope="session")
def device() -> str:
    """Where the kernel tests run: ``cuda``, or ``cpu`` (Triton's interpreter)."""
    return "cuda" if HAS_CUDA else "cpu"
