"""mla-deploy: DeepSeek-style Multi-Head Latent Attention, rewritten into its absorbed form, exported to
ONNX with the latent cache as explicit I/O, built into TensorRT engines and validated against PyTorch.

Importing the package is cheap: torch and the runtimes are imported only when a function needs them.
"""

from __future__ import annotations

from .lazy import lazy_getattr

__version__ = "0.1.0"

from .config import MLAConfig, YarnScaling, from_hf_config  # noqa: E402  (no heavy imports)
from .errors import MLADeployError  # noqa: E402
from .recipe import Recipe, load_recipe, preset_names  # noqa: E402

_LAZY = {
    "absorb": "mla_deploy.model",
    "build_model": "mla_deploy.model",
    "convert_form": "mla_deploy.model",
    "MLAForCausalLM": "mla_deploy.model",
    "load_checkpoint": "mla_deploy.checkpoint",
}

__all__ = ["MLAConfig", "YarnScaling", "from_hf_config", "MLADeployError", "Recipe", "load_recipe",
           "preset_names", "__version__", *_LAZY]

__getattr__ = lazy_getattr(__name__, _LAZY)
