"""The progress bars of the CLI and the demo: tqdm's, on standard error."""

from __future__ import annotations

import sys
from typing import Any


def progress_bar(total: int, *, desc: str, shown: bool, **options: Any) -> Any:
    """A bar of ``total`` steps (``update(n)``, ``close()``); ``shown`` False (CI logs, pipes,
    a quiet run): one that draws nothing."""
    from tqdm import tqdm  # type: ignore[import-untyped]  # no hints; types-tqdm not installed

    return tqdm(total=total, desc=desc, disable=not shown, file=sys.stderr, **options)
