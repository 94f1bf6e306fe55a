"""`ddtree serve`'s processes: one engine core process and N API server processes on one port, supervised.

- The launcher binds the port (so that a port in use fails at once), starts the engine process
  (`ddtree.server.core.engine_main`) and waits for it to load the pair and warm up; the engine answers with the
  model's card. Then it starts the API processes (`api_main`), which share the listening socket (the kernel
  spreads connections over them) and each reach the engine over ZMQ (`ddtree.server.transport`). Once every
  one listens, one line on stderr says what is served where.
- The API processes' metrics are one view: prometheus-client's multiprocess mode, in a directory of the
  launcher's, so a scrape of any of them sums them all (the engine's state comes with its messages).
- SIGTERM or SIGINT: the API processes drain (they answer what is in flight, up to `--shutdown-timeout`), then
  the engine stops; `serve` returns 0 and nothing is left running.
- The engine process dies: every open request fails at once (a 500, or an error event in a stream),
  `/health` turns 503, the API processes shut down and `serve` returns 1 (as vLLM's API server exits when its
  engine core dies: restart it under a supervisor, such as systemd or Kubernetes).
- An API process dies: the engine cancels its requests (their slots are freed at the next step) and the
  launcher starts another in its place, on the same socket.
- Every process ends when the launcher is gone, even killed (`transport.parent_gone`).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from multiprocessing.connection import Connection, wait
from multiprocessing.context import SpawnProcess
from multiprocessing.synchronize import Event
from types import FrameType
from typing import Any

import msgspec
import zmq

from ddtree.errors import SettingsError, UserError
from ddtree.server import transport as tp
from ddtree.server.card import ApiModel, ModelCard
from ddtree.server.model import ServerSettings
from ddtree.server.run import make_server, startup_line, url_of

SUPERVISE_S = 0.05  # how often the launcher looks at its processes and signals
ENGINE_STOP_S = 15.0  # the engine's own stop: its decode thread ends at a step boundary
MAX_AUTO_API_SERVERS = 4
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def serve(settings: ServerSettings, host: str, port: int) -> int:
    """The engine process, the API processes on `host:port`, until a signal (0) or the engine's death (1)."""
    return Launcher(settings, host, port).run()


def default_api_servers(cores: int | None = None) -> int:
    """A quarter of the cores, 1 to MAX_AUTO_API_SERVERS: the rest is the engine's and the clients'."""
    if cores is None:
        cores = tp.usable_cores()
    return max(1, min(MAX_AUTO_API_SERVERS, cores // 4))


def listening_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP, not 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on sockets that say TCP, and
    # with it on, a response's second write waits out the client's delayed ACK (40 ms a keep-alive request).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class Launcher:
    def __init__(self, settings: ServerSettings, host: str, port: int) -> None:
        self.settings = settings
        self.host = host
        self.count = settings.api_server_count or default_api_servers()
        self.directory = tempfile.mkdtemp(prefix="ddtree-serve-")
        self.plan = tp.Plan(self.directory, self.count, os.getpid())
        self.context = multiprocessing.get_context("spawn")
        self.sock = listening_socket(host, port)
        self.port = int(self.sock.getsockname()[1])
        self.engine: SpawnProcess | None = None
        self.apis: list[SpawnProcess | None] = [None] * self.count
        self.ready: list[Event | None] = [None] * self.count  # kept while its process may read it
        self.card: ModelCard | None = None
        self.held: list[zmq.Socket[Any]] = []  # sockets with a message on its way: one closed drops it
        self._signalled = False

    def run(self) -> int:
        """Serve until a signal (0) or the engine's death (1)."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        zctx: zmq.Context[Any] = zmq.Context()
        try:
            self.card = self._start_engine()
            os.environ[MULTIPROC_ENV] = os.path.join(self.directory, "metrics")
            os.makedirs(os.environ[MULTIPROC_ENV])
            ready = [self._start_api(i) for i in range(self.count)]
            self._wait_listening(ready)
            print(startup_line(self.card, url_of(self.host, self.port), self.count), file=sys.stderr, flush=True)
            code = self._supervise(zctx)
        finally:
            os.environ.pop(MULTIPROC_ENV, None)
            self._shut_down(zctx)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return code

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        self._signalled = True

    def _start_engine(self) -> ModelCard:
        from ddtree.server.core import engine_main

        receive, send = self.context.Pipe(duplex=False)
        engine = self.context.Process(
            target=engine_main, args=(self.settings, self.plan, send), name="ddtree-engine", daemon=False
        )
        engine.start()
        send.close()
        self.engine = engine
        answer = _answer(engine, receive, lambda: self._signalled)
        if "setting" in answer:
            raise SettingsError(str(answer["setting"]), str(answer["problem"]))
        if "error" in answer:
            raise UserError(str(answer["error"]))
        return msgspec.convert(answer["card"], ModelCard)

    def _start_api(self, index: int) -> Event:
        ready = self.context.Event()
        assert self.card is not None
        card = msgspec.msgpack.encode(self.card)
        args = (self.settings, self.plan, index, card, self.sock, self.host, ready)
        process = self.context.Process(target=api_main, args=args, name=f"ddtree-api-{index}", daemon=False)
        process.start()
        self.apis[index], self.ready[index] = process, ready
        return ready

    def _wait_listening(self, ready: list[Event]) -> None:
        while not all(event.is_set() for event in ready):
            gone = [p for p in (self.engine, *self.apis) if p is not None and not p.is_alive()]
            if gone:
                raise UserError(f"{gone[0].name} ended while the server was starting (exit code {gone[0].exitcode})")
            if self._signalled:
                raise UserError("stopped while starting")
            time.sleep(SUPERVISE_S)

    def _supervise(self, zctx: zmq.Context[Any]) -> int:
        engine = self.engine
        assert engine is not None
        to_engine = tp.push(zctx, self.plan.engine_inbox)
        while not self._signalled:
            sentinels = [engine.sentinel, *(p.sentinel for p in self.apis if p is not None)]
            wait(sentinels, timeout=SUPERVISE_S)
            if not engine.is_alive():
                print(
                    f"ddtree serve: the engine process died (exit code {engine.exitcode}); failing the open "
                    "requests and exiting",
                    file=sys.stderr,
                    flush=True,
                )
                for index in range(self.count):  # held at close until taken (the API processes are alive)
                    to_api = tp.push(zctx, self.plan.api_inbox(index))
                    to_api.setsockopt(zmq.LINGER, 1000)
                    tp.try_send(to_api, tp.EngineDead("the engine process died"))
                    self.held.append(to_api)
                return 1
            for index, process in enumerate(self.apis):
                if process is not None and not process.is_alive():
                    print(
                        f"ddtree serve: API server process {index} ended (exit code {process.exitcode}); its "
                        "requests are cancelled and another takes its place",
                        file=sys.stderr,
                        flush=True,
                    )
                    tp.try_send(to_engine, tp.Abandon(index))
                    self._start_api(index)
        return 0

    def _shut_down(self, zctx: zmq.Context[Any]) -> None:
        """Drain the API processes, then stop the engine; kill what does not end in time."""
        self.sock.close()
        apis = [p for p in self.apis if p is not None]
        for process in apis:
            if process.is_alive() and process.pid is not None:
                os.kill(process.pid, signal.SIGTERM)
        _join_or_kill(apis, self.settings.shutdown_timeout + 5.0)
        if self.engine is not None:
            if self.engine.is_alive():
                to_engine = tp.push(zctx, self.plan.engine_inbox)  # held: a socket closed at once drops it
                tp.try_send(to_engine, tp.Stop())
            _join_or_kill([self.engine], ENGINE_STOP_S)
        zctx.destroy()  # each socket's own linger
        shutil.rmtree(self.directory, ignore_errors=True)


def _answer(engine: SpawnProcess, receive: Connection, stop: Any) -> dict[str, Any]:
    """The engine's first word: its card, or why it could not start."""
    while not receive.poll(SUPERVISE_S):
        if not engine.is_alive():
            raise UserError(f"the engine process ended while loading (exit code {engine.exitcode})")
        if stop():
            raise UserError("stopped while loading the model")
    answer: dict[str, Any] = msgspec.msgpack.decode(receive.recv_bytes())
    return answer


def _join_or_kill(processes: list[SpawnProcess], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for process in processes:
        process.join(max(deadline - time.monotonic(), 0.0))
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join(5.0)


def api_main(
    settings: ServerSettings,
    plan: tp.Plan,
    index: int,
    card_bytes: bytes,
    sock: socket.socket,
    host: str,
    ready: Event,
) -> None:
    """An API server process: the app over an `EngineClient`, under uvicorn on the shared socket."""
    from ddtree.models.pair import load_tokenizer
    from ddtree.server.app import api_app
    from ddtree.server.client import EngineClient

    card = msgspec.msgpack.decode(card_bytes, type=ModelCard)
    model = ApiModel(card, load_tokenizer(card.model_dir))
    client = EngineClient(plan, index)
    app = api_app(settings, model, client, multiprocess_dir=os.environ.get(MULTIPROC_ENV))
    server = make_server(app, host, int(sock.getsockname()[1]), processes=plan.api_count)
    server.on_started = ready.set

    def parent_gone() -> None:
        server.should_exit = True

    client.on_parent_gone = parent_gone
    with contextlib.suppress(KeyboardInterrupt):
        server.run(sockets=[sock])
