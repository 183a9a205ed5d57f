"""Where Tandem keeps what it learns about a machine and its files between starts."""
from __future__ import annotations

import os
from pathlib import Path


def cache_home() -> Path:
    """$TANDEM_CACHE, else $XDG_CACHE_HOME/tandem, else ~/.cache/tandem."""
    if os.environ.get("TANDEM_CACHE"):
        return Path(os.environ["TANDEM_CACHE"]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")) / "tandem"
