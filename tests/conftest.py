"""Shared test setup: the helper modules beside this file (hf_oracle, helpers) are importable from every test folder."""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
