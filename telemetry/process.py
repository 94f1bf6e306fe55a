"""The sinks in a process of their own, so that the decode process keeps only what must be there.

The decode process runs the collector (stage marks, the tree-size copy, resolving records) and sends the
steps' numbers over a socket pair, a group at a time. The exporter process owns everything else: the
OTel SDK and its export threads, the Prometheus endpoint, NVML sampling and the log stream. Spans, metric
updates and JSON lines then cost the decode loop a pickle and a write instead of work under its
interpreter lock.

It starts as `python -m telemetry.process FD` with one end of a socket pair; messages are pickled tuples:
("config", TelemetryConfig, device_type, model_name) first, then ("start", info, texts), ("steps", [step
records]), ("end", info, results, texts), and ("close",), answered once every sink has what came before and
has closed.
The child answers ("ready", prometheus_port) or ("error", message) to the config. Nothing else waits for
an answer, so the sinks see a step shortly after it ends, not before `generate` returns.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from telemetry.config import TelemetryConfig, TelemetryConfigError
from telemetry.hooks import GenerateInfo, RequestResult
from telemetry.stats import StepStats, call_sinks

START_TIMEOUT_S = 60.0  # importing the SDK on a cold disk
CLOSE_TIMEOUT_S = 2.5  # the exporter flushes what it has and stops; `Telemetry.shutdown` bounds the whole
SEND_EVERY_STEPS = 32  # steps are sent in groups: at most this many, or this old
SEND_EVERY_S = 0.5


class ExporterGone(RuntimeError):
    """The exporter process stopped answering: the collector drops this sink and decoding goes on."""


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
            [sys.executable, "-m", "telemetry.process", str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},  # this process's imports
        )
        theirs.close()
        self.conn = Connection(ours.detach())
        self.detokenize = detokenize if config.log_content else None
        self.behind = False
        self.steps: list[tuple[Any, ...]] = []
        self.sent_at = time.monotonic()
        try:
            self._send(("config", config, device_type, model_name))
            kind, value = self._answer(START_TIMEOUT_S)
        except ExporterGone:
            self.close()
            raise TelemetryConfigError("the telemetry exporter process did not start (its error is above)") from None
        if kind == "error":
            self.close()
            raise TelemetryConfigError(value)
        self.prometheus_port: int | None = value

    def start_requests(self, info: GenerateInfo) -> None:
        texts = {tuple(p): self.detokenize(p) for p in info.prompt_tokens} if self.detokenize else {}
        self._send(("start", info, texts))

    def step(self, stats: StepStats) -> None:
        s = stats
        tree = (s.tokens, s.parents, s.log_probs)
        self.steps.append(
            (s.step, s.active, s.depths, s.accepted, s.emitted, s.stage_ns, s.start_ns, s.end_ns, s.slot_ids, *tree)
        )
        if len(self.steps) >= SEND_EVERY_STEPS or time.monotonic() - self.sent_at >= SEND_EVERY_S:
            self._send_steps()

    def _send_steps(self) -> None:
        """One write for the steps gathered so far (a syscall per step costs more than the step's record)."""
        steps, self.steps, self.sent_at = self.steps, [], time.monotonic()
        if not steps:
            return
        if not select.select([], [self.conn], [], 0)[1]:  # the exporter is behind: steps are not worth a stall
            if not self.behind:
                warnings.warn("ddtree telemetry: the exporter process is behind; steps are dropped", stacklevel=3)
            self.behind = True
            return
        self._send(("steps", steps))

    def end_requests(self, info: GenerateInfo, results: list[RequestResult]) -> None:
        texts = {tuple(r.output_tokens): self.detokenize(r.output_tokens) for r in results} if self.detokenize else {}
        self._send_steps()
        self._send(("end", info, results, texts))

    def close(self) -> None:
        with contextlib.suppress(ExporterGone):
            self._send(("close",))
            self._answer(CLOSE_TIMEOUT_S)
        with contextlib.suppress(OSError):
            self.conn.close()
        try:
            self.process.wait(CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()

    def _send(self, message: tuple[Any, ...]) -> None:
        try:
            self.conn.send(message)
        except OSError as exc:  # including a broken pipe: ours, not the user's stdout
            raise ExporterGone(f"telemetry exporter process is gone: {exc}") from None

    def _answer(self, timeout_s: float) -> Any:
        try:
            if self.conn.poll(timeout_s):
                return self.conn.recv()
        except (OSError, EOFError):
            pass
        raise ExporterGone("telemetry exporter process did not answer")


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
    from telemetry.setup import build_sinks

    lower_priority()
    _, config, device_type, model_name = conn.recv()
    texts: dict[tuple[int, ...], str] = {}
    try:
        sinks, closers, port = build_sinks(config, device_type, model_name, lambda ids: texts.get(tuple(ids), ""))
    except TelemetryConfigError as exc:
        conn.send(("error", str(exc)))
        return
    conn.send(("ready", port))
    info: GenerateInfo | None = None
    try:
        while True:
            try:
                message = conn.recv()
            except EOFError:
                break  # the decode process is gone
            kind = message[0]
            if kind == "start":
                info = message[1]
                texts.update(message[2])
                call_sinks(sinks, "start_requests", info)
            elif kind == "steps" and info is not None:
                for step in message[1]:
                    call_sinks(sinks, "step", StepStats(step[0], info, *step[1:]))
            elif kind == "end":
                texts.update(message[3])
                call_sinks(sinks, "end_requests", message[1], message[2])
                for ids in [*message[1].prompt_tokens, *(r.output_tokens for r in message[2])]:
                    texts.pop(tuple(ids), None)  # other requests may still be decoding
            elif kind == "close":
                break
    except BrokenPipeError:
        pass  # the log's reader went away (`| head`); the decode process sees it on its own output
    finally:
        for close in closers:
            with contextlib.suppress(Exception):  # shutting down: nothing left to protect but the exit
                close()
        with contextlib.suppress(OSError):
            conn.send(("ok", None))


if __name__ == "__main__":
    serve(Connection(int(sys.argv[1])))
