"""Child processes that tests signal start with SIGINT and SIGHUP at their default actions, as from a
terminal, whatever started pytest: `nohup` and a non-interactive shell's background jobs leave them
ignored, an ignored signal stays ignored across exec, and a child that ignores them cannot show what a
signal does to a run."""

import signal


def default_signal_actions() -> None:
    """A `preexec_fn`: SIGINT and SIGHUP back to their default actions in the child before it starts."""
    for signum in (signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
