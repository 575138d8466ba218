"""The exit statuses of the ``embedingest`` commands, defined once.

A job's summary carries its status as ``exit_code`` (from :func:`exit_code`); the CLI
exits with it, with :data:`EXIT_INTERRUPTED` on Ctrl-C (:data:`EXIT_TERMINATED` on
SIGTERM), and click exits with :data:`EXIT_ERROR` on an error and :data:`EXIT_USAGE`
on a command line it refuses.
"""

from __future__ import annotations

# Every input done.
EXIT_OK = 0
# An error; its message says what to change (click.ClickException's status).
EXIT_ERROR = 1
# A command line refused before any work (an unknown option, an input that does not
# exist): click's usage-error status.
EXIT_USAGE = 2
# The run finished, but some inputs were skipped (each listed in skipped.jsonl with why).
EXIT_SKIPPED = 3
# Interrupted (Ctrl-C): what was committed is kept, the same command resumes.
EXIT_INTERRUPTED = 130
# Stopped by SIGTERM (timeout, docker stop, a batch system), as by Ctrl-C otherwise; the
# status a shell shows for a process SIGTERM ended.
EXIT_TERMINATED = 143


def exit_code(skipped: int) -> int:
    """The status of a finished run that skipped ``skipped`` inputs."""
    return EXIT_SKIPPED if skipped else EXIT_OK


def exit_status_help(done: str, inputs: str, where: str) -> str:
    """The paragraph of a job command's help that says what each status means."""
    return (f"Exit status: {EXIT_OK} {done}; {EXIT_SKIPPED} finished, but some {inputs} were "
            f"skipped (see skipped.jsonl in {where}); {EXIT_ERROR} error; {EXIT_USAGE} a command line "
            f"refused before any work; {EXIT_INTERRUPTED} "
            f"interrupted, {EXIT_TERMINATED} stopped by SIGTERM (run the same command again to "
            "resume).")
