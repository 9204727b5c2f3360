"""One rank's stand-in under `plait-train --nproc-per-node` with forked ranks (rank_factory.py).

torch's elastic agent starts this script (`python -I -S rank_client.py ARGS`) where it would start
`python -m plait.trainer ARGS`. It asks the launcher's rank factory (the unix socket in
PLAIT_RANK_FACTORY) to fork the rank, hands it this process's environment (RANK, LOCAL_RANK, the
rendezvous: what the agent set), working directory, stdin, stdout and stderr, forwards every signal
the agent sends it, and exits as the rank did: with its exit code, or killed by the same signal. So
the agent's restarts, failure reports and shutdown work on the rank as on a spawned one.

Standard library only, and run without `site`: it starts in milliseconds, where a spawned rank
spends seconds importing torch and the trainer.
"""

import json
import os
import signal
import socket
import sys

# What the agent (or a user at the process) may send a rank; SIGKILL cannot be caught: the factory
# kills the rank when this process's end of the socket closes.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
FACTORY_GONE = 74  # exit_codes.INFRA: the launcher's factory died under a running rank


def main() -> None:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    conn.connect(os.environ["PLAIT_RANK_FACTORY"])
    request = {"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd()}
    socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
    reply = conn.recv(64)
    if not reply:
        os._exit(FACTORY_GONE)
    pid = int(reply)

    def forward(signum, _frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for signum in FORWARDED:
        signal.signal(signum, forward)
    reply = conn.recv(64)  # the rank's wait status, once it ended (recv resumes after a forwarded signal)
    if not reply:
        os._exit(FACTORY_GONE)
    status = int(reply)
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        if signum not in (signal.SIGKILL, signal.SIGSTOP):  # their action cannot be changed
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)  # the agent reads -signum, as for a spawned rank
        os._exit(128 + signum)  # a signal whose default action is not to end the process
    os._exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main()
