"""What `plait-train` exits with, so schedulers can tell a finished run from one to requeue.

The same code is written to `<job.dump_folder>/exit_status` by whoever held the run's lock (the
plait launcher, or rank 0), because torchrun reports any failing rank as its own exit code 1:
a batch script reads the file to decide (`running` there means the run was killed before it
could write its code, which also calls for a requeue).
"""

FINISHED = 0  # the run finished its training.steps (or had nothing left to train)
DIVERGED = 1  # NaN / inf loss or grad norm; nothing non-finite was checkpointed
CONFIG = 2  # a configuration or checkpoint error, one line (also: the dump folder is in use)
STOPPED = 75  # stopped before its last step (SIGTERM): run the same command to resume (EX_TEMPFAIL)
INTERRUPTED = 130  # Ctrl-C

STATUS_FILE = "exit_status"
RUNNING = "running"
