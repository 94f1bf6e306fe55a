"""A server that streams at once: what `bench_serve.py` can take at most (the load generator's own ceiling).

    python benchmarks/stub_server.py --port 8300 --processes 2 &
    python benchmarks/bench_serve.py --url http://127.0.0.1:8300 --clients 64 --requests 256 --max-tokens 128

`POST /v1/completions` answers with `max_tokens` SSE chunks of one token each, then the usage chunk and
`[DONE]`, with nothing between them: no model, no tokenizer, raw asyncio streams (no framework), keep-alive,
chunked transfer encoding. `--processes N` runs N of them on the port (SO_REUSEPORT). Whatever tokens/s the
load generator reports against it is its ceiling on this machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import socket
import sys

HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"


def _chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _event(body: dict[str, object]) -> bytes:
    return _chunk(b"data: " + json.dumps(body).encode() + b"\n\n")


async def _serve_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n"):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            body = json.loads(await reader.readexactly(length)) if length else {}
            tokens = int(body.get("max_tokens") or 16)
            writer.write(HEAD)
            piece = {"object": "text_completion", "choices": [{"index": 0, "text": "x", "finish_reason": None}]}
            for _ in range(tokens):
                writer.write(_event(piece))
                await writer.drain()
            usage = {"prompt_tokens": 1, "completion_tokens": tokens, "total_tokens": tokens + 1}
            writer.write(_event({"choices": [], "usage": usage}))
            writer.write(_chunk(b"data: [DONE]\n\n") + _chunk(b""))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    finally:
        writer.close()


def _run(sock: socket.socket) -> None:
    async def main() -> None:
        server = await asyncio.start_server(_serve_connection, sock=sock)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def _socket(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8300)
    parser.add_argument("--processes", type=int, default=1)
    args = parser.parse_args()
    workers = [
        multiprocessing.Process(target=_run, args=(_socket(args.host, args.port),), daemon=True)
        for _ in range(args.processes)
    ]
    for worker in workers:
        worker.start()
    print(f"stub_server: {args.processes} processes at http://{args.host}:{args.port}", file=sys.stderr, flush=True)
    try:
        for worker in workers:
            worker.join()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
