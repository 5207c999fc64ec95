"""Developer tooling that makes the shipped models: draft training, profiling traces,
predictor fitting (torch and scikit-learn are imported only here)."""

from __future__ import annotations

import sys
import time

from memspec.errors import MemspecError


def require_torch():
    """torch, or a MemspecError that names the extra to install (draft training only)."""
    try:
        import torch
    except ImportError:
        raise MemspecError("draft training needs PyTorch: pip install 'memspec[train]'") from None
    return torch


def log(msg: str) -> None:
    """One timestamped progress line of draft training, on stderr."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
