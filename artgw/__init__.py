"""ART Gateway's command line (`artgw`)."""

import contextlib
import faulthandler
import signal

# `kill -USR1 <pid>` prints every thread's stack to stderr: where a command that seems stuck is, even while it
# still imports its dependencies (a trainer once sat silent at start with no stack dump: its handler was
# registered only after the imports). Here, the first module `artgw` runs.
with contextlib.suppress(ValueError, AttributeError, OSError):  # stderr without a file descriptor (captured)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
