"""The ``dinfer-rt`` executable's entry point: imports the command line inside a guard, so a
Ctrl-C during start-up (while torch imports) prints ``interrupted`` and exits 130, as it does
once a command runs."""

from __future__ import annotations

import sys


def main() -> int:
    try:
        from dinfer_rt.cli import main as run
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return run()
