"""Progress on long start-up work (compiling decode steps, building kernels): the lines a
user waits for. They go to the ``tandem.progress`` logger, which the command line shows
at the default --log-level (WARNING) and hides only at ERROR or above, so a first
start that compiles for a minute says what it is doing instead of printing nothing.
"""
from __future__ import annotations

import logging

progress = logging.getLogger("tandem.progress")


def show_progress(level: int) -> None:
    """Let progress lines through at ``level`` (the root's): INFO unless ERROR or above."""
    progress.setLevel(logging.INFO if level <= logging.WARNING else level)
