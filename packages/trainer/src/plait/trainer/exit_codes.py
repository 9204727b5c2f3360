"""What `plait-train` exits with, so schedulers can tell a finished run from one to requeue.

The same code is written to `<job.dump_folder>/exit_status` by whoever held the run's lock (the
plait launcher, or rank 0), because torchrun reports any failing rank as its own exit code 1:
a batch script reads the file to decide (`running` there means the run was killed before it
could write its code, which also calls for a requeue).
"""

FINISHED = 0  # the run finished its training.steps (or had nothing left to train)
ERROR = 1  # an unexpected error (a bug): Python's own code for an uncaught exception, with its traceback
CONFIG = 2  # a configuration or checkpoint error, one line (also: the dump folder is in use)
DIVERGED = 3  # NaN / inf loss or grad norm; nothing non-finite was checkpointed (was 1, Python's crash code)
INFRA = 74  # infrastructure fault: an I/O error (disk full, read-only), out of memory, a rank died or
#             was killed (OOM killer), a lost peer: requeue, on other nodes if it repeats (EX_IOERR)
STOPPED = 75  # stopped before its last step (SIGTERM, preempted): run the same command to resume (EX_TEMPFAIL)
INTERRUPTED = 130  # Ctrl-C

REQUEUE = (INFRA, STOPPED)  # codes a scheduler requeues (and `running` in exit_status: killed outright)


class InfrastructureFault(Exception):
    """A fault of the machine, not of the run's settings (a write that failed: disk full,
    read-only); one line naming what and where, exit INFRA."""


STATUS_FILE = "exit_status"
RUNNING = "running"
