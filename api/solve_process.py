"""Bounded solves: each solve runs in a child process of its own, which the parent can kill.

Why a process per solve: a thread cannot be stopped from outside, so a solve in a thread could neither
be timed out nor cancelled, and a solver that runs out of memory would take the service with it. A child
process can be killed (`SIGKILL`) at the time limit or on a cancel, and when it dies on its own (killed
by the OOM killer, a crash) the parent sees it at once and carries on with a fresh child for the next
solve. `concurrent.futures.ProcessPoolExecutor` cannot kill one task, hence this small supervisor.

Children start from a `forkserver` that has imported the solvers once (`PRELOADED_MODULES`), so a
child costs a fork, not an interpreter start, and nothing is forked from the multi-threaded server
itself. The parent sends the request as JSON text and receives bytes (`ANSWER_RESULT` or
`ANSWER_ERROR`, then JSON text): it never unpickles anything a child sends. A child whose server died
(SIGKILL leaves no one to kill it) exits as soon as the read end of its answer pipe is gone
(`_exit_when_orphaned`). Waiting to be re-parented would not do: every forkserver child holds the pipe
that tells the forkserver its server is alive, so the forkserver outlives the server while a child runs.

This module does not import FastAPI.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import select
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from enum import Enum
from multiprocessing.connection import Connection

from planner.errors import PlannerError

from .jobs import JobError

__all__ = ["ChildEnding", "ChildOutcome", "SolveTarget", "run_bounded", "start_forkserver"]

log = logging.getLogger(__name__)

SolveTarget = Callable[[str], str]
"""A module-level function from request JSON text to answer JSON text (it runs in the child)."""

ANSWER_RESULT = b"R"
ANSWER_ERROR = b"E"
PRELOADED_MODULES = [__name__.rpartition(".")[0] + ".solve_targets"]
"""Imported once by the forkserver, so that every child starts with the solvers loaded. Named from this
module's package (planner_service), not spelled out: the forkserver ignores an ImportError in its
preload, so a wrong name would go unnoticed and every solve would import the solvers again."""
EXIT_ORPHANED = 3
"""A child's exit status when it stopped because its server died."""
CHECK_INTERVAL_S = 0.05
"""How often the parent looks at the child's clock and at `keep_going`."""


class ChildEnding(Enum):
    """How a bounded solve ended."""

    ANSWERED = "answered"
    """The child sent a result or the solver's error."""
    TIMED_OUT = "timed_out"
    """It ran past its time limit and was killed."""
    STOPPED = "stopped"
    """`keep_going` said no (a cancel, a lost lease, a shutdown) and it was killed."""
    CRASHED = "crashed"
    """It died without answering (killed from outside, out of memory, a crash of the interpreter)."""


@dataclass(frozen=True)
class ChildOutcome:
    """What became of one bounded solve."""

    ending: ChildEnding
    elapsed_s: float
    result_json: str | None = None
    """The answer's JSON text, when ANSWERED without an error."""
    error: JobError | None = None
    """The solver's error, when ANSWERED with one."""
    exit_code: int | None = None
    """The child's exit status when it CRASHED (negative: the signal that killed it)."""


def _context() -> multiprocessing.context.ForkServerContext:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOADED_MODULES)
    return context


def start_forkserver() -> None:
    """Start the forkserver now (it imports the solvers, about a second), not at the first solve."""
    _context()
    multiprocessing.forkserver.ensure_running()


def _exit_when_orphaned(answer_fd: int) -> None:
    """Exit once nobody can read the answer: a pipe's write end reports POLLERR when its readers are gone."""
    poller = select.poll()
    poller.register(answer_fd, 0)  # no events asked for: POLLERR and POLLHUP are always reported
    while True:
        for _, events in poller.poll():
            if events & (select.POLLERR | select.POLLHUP):
                os._exit(EXIT_ORPHANED)


def _child_main(target: SolveTarget, request_json: str, answer: Connection) -> None:
    threading.Thread(target=_exit_when_orphaned, args=(answer.fileno(),), daemon=True).start()
    try:
        message = ANSWER_RESULT + target(request_json).encode()
    except Exception as error:  # noqa: BLE001 - every failure goes back to the parent, bugs included
        if not isinstance(error, PlannerError):
            log.exception("the solver failed unexpectedly")
        message = ANSWER_ERROR + json.dumps(asdict(JobError.from_exception(error))).encode()
    answer.send_bytes(message)  # left open: the process's exit closes it, after the watcher's last look


def _read_answer(message: bytes, elapsed_s: float) -> ChildOutcome:
    tag, body = message[:1], message[1:].decode()
    if tag == ANSWER_RESULT:
        return ChildOutcome(ChildEnding.ANSWERED, elapsed_s, result_json=body)
    assert tag == ANSWER_ERROR, f"a solver child sent an answer tagged {tag!r}"
    return ChildOutcome(ChildEnding.ANSWERED, elapsed_s, error=JobError(**json.loads(body)))


def run_bounded(
    target: SolveTarget, request_json: str, *, timeout_s: float, keep_going: Callable[[], bool]
) -> ChildOutcome:
    """Run `target(request_json)` in a child; kill it past `timeout_s` or once `keep_going()` is False.

    Blocks the calling thread (a worker thread) until the child answers, dies or is killed.
    """
    context = _context()
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=_child_main, args=(target, request_json, sender), daemon=True)
    started = time.monotonic()
    child.start()
    sender.close()
    try:
        while True:
            elapsed_s = time.monotonic() - started
            if receiver.poll(CHECK_INTERVAL_S):
                try:
                    return _read_answer(receiver.recv_bytes(), time.monotonic() - started)
                except EOFError:  # the child closed the pipe by dying before it answered
                    child.join()
                    return ChildOutcome(ChildEnding.CRASHED, elapsed_s, exit_code=child.exitcode)
            if elapsed_s >= timeout_s:
                return ChildOutcome(ChildEnding.TIMED_OUT, elapsed_s)
            if not keep_going():
                return ChildOutcome(ChildEnding.STOPPED, elapsed_s)
    finally:
        if child.is_alive():
            child.kill()
        child.join()
        receiver.close()
