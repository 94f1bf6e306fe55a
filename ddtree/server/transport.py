"""The messages between the API server processes and the engine core process, and how they travel.

MessagePack through msgspec, decoded into the typed messages below: bytes that do not decode into one of them
raise `msgspec.ValidationError` (no pickle ever reads a socket). ZMQ carries them over `ipc://` sockets in a
directory of the server's own, one way each:

    API process i --PUSH--> engine inbox (PULL, bound by the engine)   Submit, Cancel
    launcher      --PUSH--> engine inbox                               Abandon (API process i is gone), Stop
    engine        --PUSH--> API i's inbox (PULL, bound by API i)       Outputs (one per round: a step, a join),
                                                                       Rejected, Status
    launcher      --PUSH--> API i's inbox                              EngineDead

A request is known by (API process, its number there). The engine's sends never block: a message that an API
process cannot take (it has gone) is dropped and counted (`Link.dropped`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from ddtree.engine.requests import Request

HIGH_WATER = 1 << 16  # messages a socket may hold for a slow peer before sends fail (Again) instead


class Submit(msgspec.Struct, tag="submit"):
    api: int
    rid: int
    request: Request  # resolved once, in the API process


class Cancel(msgspec.Struct, tag="cancel"):
    api: int
    rid: int
    reason: str = "cancelled"  # the finish reason telemetry reports ("stop": a stop string matched)


class Abandon(msgspec.Struct, tag="abandon"):
    """API process `api` is gone: cancel every request of its."""

    api: int


class Stop(msgspec.Struct, tag="stop"):
    pass


class Out(msgspec.Struct, array_like=True):
    """One request's share of a round (`ddtree.server.worker.Update`, plus its queue and prefill times with the
    first that carries them)."""

    rid: int
    token_ids: list[int]
    acceptance_lengths: list[int]
    budgets: list[int]
    scores: list[tuple[float, list[tuple[int, float]]]]
    finish_reason: str | None = None
    error: str | None = None
    queue_seconds: float | None = None  # with the request's first update: from submit to joining a slot
    gains: list[float] = []  # per adaptive decode step: its predicted gain over ar
    prefill_seconds: float | None = None  # with the request's first tokens: from joining a slot to handing them over


class Status(msgspec.Struct, tag="status"):
    """The engine's state, with every message it sends (the API's `/metrics` and `/health` read it)."""

    waiting: int = 0
    running: int = 0
    slots: int = 0
    alive: bool = True
    dropped: dict[str, int] = msgspec.field(default_factory=dict)  # telemetry's dropped records, by kind


class Outputs(msgspec.Struct, tag="outputs"):
    outs: list[Out]
    status: Status


class Rejected(msgspec.Struct, tag="rejected"):
    rid: int
    reason: str  # worker.REJECTED_QUEUE_FULL or worker.REJECTED_STOPPED
    message: str
    status: Status


class EngineDead(msgspec.Struct, tag="engine_dead"):
    message: str


ToEngine = Submit | Cancel | Abandon | Stop
ToApi = Outputs | Rejected | Status | EngineDead

_encoder = msgspec.msgpack.Encoder()
_to_engine = msgspec.msgpack.Decoder(ToEngine)
_to_api = msgspec.msgpack.Decoder(ToApi)


def encode(message: ToEngine | ToApi) -> bytes:
    return _encoder.encode(message)


def decode_for_engine(data: bytes) -> ToEngine:
    return _to_engine.decode(data)


def decode_for_api(data: bytes) -> ToApi:
    return _to_api.decode(data)


@dataclass(frozen=True)
class Plan:
    """Where the sockets are: a directory of the launcher's own (`ipc://` paths are files)."""

    directory: str
    api_count: int
    launcher_pid: int  # the processes end when it is gone

    @property
    def engine_inbox(self) -> str:
        return f"ipc://{os.path.join(self.directory, 'engine')}"

    def api_inbox(self, index: int) -> str:
        return f"ipc://{os.path.join(self.directory, f'api-{index}')}"


def push(context: zmq.Context[Any], address: str) -> zmq.Socket[Any]:
    """A sending socket that never blocks the sender for long and never holds on at close."""
    sock: zmq.Socket[Any] = context.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, HIGH_WATER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def try_send(sock: zmq.Socket[Any], message: ToEngine | ToApi) -> bool:
    """Send without waiting; False where the peer cannot take it (gone, or `HIGH_WATER` behind)."""
    try:
        sock.send(encode(message), flags=zmq.NOBLOCK, copy=False)
    except zmq.ZMQError:
        return False
    return True


def usable_cores() -> int:
    """The cores this process may run on: the launcher divides them between the engine and the API processes."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def parent_gone(plan: Plan) -> bool:
    """The launcher has died (this process was re-parented): time to end."""
    return os.getppid() != plan.launcher_pid
