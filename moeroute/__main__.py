"""``python -m moeroute``: the command line of moeroute.cli."""

import os
import sys

from moeroute.cli import main

try:
    status = main()
    sys.stdout.flush()
except BrokenPipeError:
    # Output piped into a reader that closed early (e.g. head): stop quietly.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    status = 1
raise SystemExit(status)
