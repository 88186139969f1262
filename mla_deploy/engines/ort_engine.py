"""Deprecated import path, kept for one release (0.2 removes it): the module is :mod:`mla_deploy.ort.engine`."""

import warnings

warnings.warn("mla_deploy.engines.ort_engine is deprecated and will be removed in 0.2: import OrtEngine from mla_deploy.ort.engine "
              "(or from mla_deploy.engines)", DeprecationWarning, stacklevel=2)

from mla_deploy.ort.engine import *  # noqa: E402,F401,F403
from mla_deploy.ort.engine import OrtEngine  # noqa: E402,F401
