"""Deprecated import path, kept for one release (0.2 removes it): the module is :mod:`mla_deploy.trt.engine`."""

import warnings

warnings.warn("mla_deploy.engines.trt_engine is deprecated and will be removed in 0.2: import TrtEngine from mla_deploy.trt.engine "
              "(or from mla_deploy.engines)", DeprecationWarning, stacklevel=2)

from mla_deploy.trt.engine import *  # noqa: E402,F401,F403
from mla_deploy.trt.engine import TrtEngine  # noqa: E402,F401
