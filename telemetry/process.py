"""The sinks in a process of their own, so that the decode process keeps only what must be there.

The decode process runs the collector (stage marks, the tree-size copy, resolving records) and hands the
steps' numbers to an `Outbox` (`telemetry.outbox`), whose thread writes them to a socket pair, a group at a
time. No thread that decodes or serves ever writes to the socket itself, so a sink that stops draining (a log
pipe whose reader stalls) costs dropped records, counted, and never a stalled step. The exporter process owns
everything else: the OTel SDK and its export threads, the Prometheus endpoint, NVML sampling and the log
stream. Spans, metric updates and JSON lines then cost the decode loop an append instead of work under its
interpreter lock.

It starts as `python -m telemetry.process FD PARENT_PID` with one end of a socket pair; messages are pickled
tuples: ("config", TelemetryConfig, device_type, model_name) first, then ("start", info, texts), ("steps",
[step records]), ("end", info, results, texts), ("dropped", DropReport), and ("close",), answered once every
sink has what came before and has closed. The child answers ("ready", prometheus_port) or ("error", message)
to the config. Nothing else waits for an answer, so the sinks see a step shortly after it ends, not before
`generate` returns. The child ends with its parent: it watches the parent's pid from a thread of its own,
which works even while its main thread is blocked writing to a stalled sink.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from ddtree.observer import GenerateInfo, RequestResult
from telemetry.config import TelemetryConfig, TelemetryConfigError
from telemetry.outbox import DropLedger, DropReport, Outbox
from telemetry.stats import StepStats, call_sinks

START_TIMEOUT_S = 60.0  # importing the SDK on a cold disk
EXIT_WAIT_S = 5.0  # how long a start that failed waits for the exporter process's exit code
CLOSE_TIMEOUT_S = 2.5  # the exporter flushes what it has and stops; `Telemetry.shutdown` bounds the whole
PARENT_POLL_S = 0.5  # how often the exporter process checks that its parent is alive
RECORD_BYTES = 256  # a step record's fixed part, pickled (its arrays are counted by their sizes)


class ExporterGone(RuntimeError):
    """The exporter process stopped answering: decoding goes on without it."""


class ExporterProcess:
    """A `StatsSink` in the decode process that hands every call to the sinks in the exporter process."""

    def __init__(
        self,
        config: TelemetryConfig,
        device_type: str,
        model_name: str,
        detokenize: Callable[[list[int]], str] | None,
    ) -> None:
        ours, theirs = socket.socketpair()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "telemetry.process", str(theirs.fileno()), str(os.getpid())],
            pass_fds=[theirs.fileno()],
            env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},  # this process's imports
        )
        theirs.close()
        self.conn = Connection(ours.detach())
        self.detokenize = detokenize if config.log_content else None
        self.ledger = DropLedger()
        try:
            self.conn.send(("config", config, device_type, model_name))
            kind, value = self._answer(START_TIMEOUT_S)
        except (ExporterGone, OSError):
            try:  # a child that failed has closed its end and may still be exiting: wait for its code
                code: int | None = self.process.wait(timeout=EXIT_WAIT_S)
            except subprocess.TimeoutExpired:
                code = None
            self.close()
            why = f"exited with code {code}; its error is above" if code is not None else "did not answer"
            raise TelemetryConfigError(f"the telemetry exporter process {why}") from None
        if kind == "error":
            self.close()
            raise TelemetryConfigError(value)
        self.prometheus_port: int | None = value
        self.outbox: Outbox | None = Outbox(self.conn, config.buffer_bytes, self.ledger)

    def drain(self) -> bool:
        """Wait while the exporter takes the records queued so far (`Outbox.drain`); True if it has them all."""
        return self.outbox is None or self.outbox.drain()

    def dropped(self) -> dict[str, int]:
        """Records dropped since start, by kind (`semconv.DROPPED_*`)."""
        return self.ledger.counts()

    def start_requests(self, info: GenerateInfo) -> None:
        texts = {tuple(p): self.detokenize(p) for p in info.prompt_tokens} if self.detokenize else {}
        size = RECORD_BYTES + 8 * sum(len(p) for p in info.prompt_tokens)
        self._requests(("start", info, texts), size, info.request_ids)

    def step(self, stats: StepStats) -> None:
        s = stats
        tree = (s.tokens, s.parents, s.log_probs)
        size = RECORD_BYTES + 8 * len(s.active) + sum(a.nbytes for a in (s.depths, *tree, s.ranks) if a is not None)
        # StepStats's fields in order, less `info` (the exporter has it from the requests' start), then the tree
        # the step verified (a session whose budget follows the load changes it between steps)
        record: tuple[Any, ...] = (s.step, s.active, s.depths, s.accepted, s.emitted, s.stage_ns, s.start_ns)
        record += (s.end_ns, s.slot_ids, *tree, s.warmup, s.rows, s.ranks, s.gain, s.info.tree)
        if self.outbox is None:
            self.ledger.add_steps([s.step])
        else:
            self.outbox.put_step(s.step, record, size)

    def end_requests(self, info: GenerateInfo, results: list[RequestResult]) -> None:
        texts = {tuple(r.output_tokens): self.detokenize(r.output_tokens) for r in results} if self.detokenize else {}
        size = RECORD_BYTES * len(results) + 8 * sum(len(r.output_tokens) for r in results)
        self._requests(("end", info, results, texts), size, [r.request_id for r in results])

    def _requests(self, message: tuple[Any, ...], size: int, request_ids: list[str]) -> None:
        if self.outbox is None:
            self.ledger.add_requests(request_ids)
        else:
            self.outbox.put_requests(message, size, request_ids)

    def close(self) -> None:
        """Send what is queued (while the exporter keeps taking it), let the exporter close its sinks, and make
        sure the process ends: killed if it has not within `CLOSE_TIMEOUT_S` after that."""
        outbox, self.outbox = getattr(self, "outbox", None), None
        if outbox is not None:
            outbox.close(("close",), CLOSE_TIMEOUT_S)  # answered once the sinks are closed
        with contextlib.suppress(OSError):
            self.conn.close()
        try:
            self.process.wait(CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def _answer(self, timeout_s: float) -> Any:
        try:
            if self.conn.poll(timeout_s):
                return self.conn.recv()
        except (OSError, EOFError):
            pass
        raise ExporterGone("telemetry exporter process did not answer")


def watch_parent(parent_pid: int) -> None:
    """End this process as soon as `parent_pid` is no longer its parent (the parent died, whatever the cause),
    from a daemon thread: the main thread may be blocked in a write to a sink that stopped draining."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        os._exit(0)

    threading.Thread(target=watch, name="ddtree-parent-watch", daemon=True).start()


def lower_priority() -> None:
    """Idle scheduling where the OS has it (else the lowest niceness): the exporter takes only CPU time that
    decoding leaves, and a step it receives never preempts the decode thread on its core."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return
    with contextlib.suppress(OSError):
        os.nice(19)


def serve(conn: Connection) -> None:
    """The exporter process: build the sinks from the config message, then feed them until closed."""
    from telemetry.sinks import build_sinks

    lower_priority()
    _, config, device_type, model_name = conn.recv()
    texts: dict[tuple[int, ...], str] = {}
    try:
        built = build_sinks(config, device_type, model_name, lambda ids: texts.get(tuple(ids), ""))
    except TelemetryConfigError as exc:
        conn.send(("error", str(exc)))
        return
    conn.send(("ready", built.port))
    feed = _Feed(built.sinks, texts, built.report_drops)
    try:
        while True:
            try:
                message = conn.recv()
            except EOFError:
                break  # the decode process is gone
            if message[0] == "close":
                break
            feed.take(message)
            conn.send(("ack",))  # the sinks have it (`Outbox` counts what was never acknowledged)
    except BrokenPipeError:
        pass  # the log's reader went away (`| head`); the decode process sees it on its own output
    finally:
        for close in built.closers:
            with contextlib.suppress(Exception):  # shutting down: nothing left to protect but the exit
                close()
        with contextlib.suppress(OSError):
            conn.send(("ok", None))


class _Feed:
    """The exporter process's side: each message from the decode process to the sinks."""

    def __init__(self, sinks: list[Any], texts: dict[tuple[int, ...], str], report: Callable[[DropReport], None]):
        self.sinks, self.texts, self.report = sinks, texts, report
        self.info: GenerateInfo | None = None
        self.orphans = DropLedger()  # steps that came before any start (whose start record was dropped)

    def take(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "start":
            self.info = message[1]
            self.texts.update(message[2])
            call_sinks(self.sinks, "start_requests", self.info)
        elif kind == "steps":
            if self.info is None:
                self.orphans.add_steps([step[0] for step in message[1]])
                self.report(self.orphans.take() or DropReport())
                return
            for step in message[1]:
                call_sinks(self.sinks, "step", StepStats(step[0], self.info.with_tree(*step[-1]), *step[1:-1]))
        elif kind == "end":
            info, results = message[1], message[2]
            self.texts.update(message[3])
            call_sinks(self.sinks, "end_requests", info, results)
            for ids in [*info.prompt_tokens, *(r.output_tokens for r in results)]:
                self.texts.pop(tuple(ids), None)  # other requests may still be decoding
        elif kind == "dropped":
            self.report(message[1])


def main(argv: list[str]) -> None:
    watch_parent(int(argv[2]))
    serve(Connection(int(argv[1])))


if __name__ == "__main__":
    main(sys.argv)
