"""``python -m embedingest``: the command line. A Ctrl-C while the command line itself is
still loading (click, the configs) ends the run as one later does: a line, no traceback,
exit status EXIT_INTERRUPTED."""

import sys

try:
    from .cli import run
except KeyboardInterrupt:
    from .exit_codes import EXIT_INTERRUPTED

    sys.stderr.write("\ninterrupted: nothing was started yet; run the same command again\n")
    sys.exit(EXIT_INTERRUPTED)

run()
