"""One real ddtree run's spans in Arize Phoenix, a trace viewer that runs on this machine, read back through
Phoenix's REST API; with `--screenshot`, headless Chromium photographs one decode step's trace in its UI.

    python scripts/phoenix_trace.py [--phoenix-python PY] [--model DIR --drafter DIR] [--prompts N]
                                     [--protocol http/protobuf|grpc] [--screenshot PNG] [--keep] [--json FILE]

Phoenix lives in a virtualenv of its own (`make setup-phoenix`, or `$DDTREE_PHOENIX_PYTHON`), never in the
main install. The script starts it on 127.0.0.1 on free ports with a throwaway database, runs `ddtree
generate` with `DDTREE_DEBUG_METRICS=1` and the OTLP exporter pointed at it (by default on a random tiny pair
made on the spot), waits until Phoenix holds one `ddtree.step` span per step of the run's step log, and
checks that each step has exactly its four stage spans as children, inside its time. It exits 1 if anything
is missing. `--keep` leaves Phoenix running to browse until Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

from telemetry import semconv

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PHOENIX_PYTHON = ROOT / ".venv-phoenix" / "bin" / "python"
STAGE_SPANS = tuple(semconv.stage_span_name(stage) for stage in semconv.STAGES)
PROMPTS = ("Hello, tree", "Explain recursion.", "Why is the sky blue?", "Name three prime numbers.")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return json.loads(reply.read())


class Phoenix:
    """A Phoenix server in its own process, on loopback, with a database in `workdir`."""

    def __init__(self, python: str, workdir: Path) -> None:
        self.started = time.monotonic()
        self.port, self.grpc_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ)
        env.update(
            PHOENIX_WORKING_DIR=str(workdir),
            PHOENIX_HOST="127.0.0.1",
            PHOENIX_PORT=str(self.port),
            PHOENIX_GRPC_PORT=str(self.grpc_port),
            PHOENIX_TELEMETRY_ENABLED="false",  # no usage pixels
            PHOENIX_ALLOW_EXTERNAL_RESOURCES="false",  # no fonts, docs or sandbox downloads from the internet
            PHOENIX_LOG_MIGRATIONS="false",
        )
        self.log_path = workdir / "phoenix.log"
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [python, "-m", "phoenix.server.main", "serve"],
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout_s: float = 180.0) -> float:
        """Seconds from launch until `/healthz` answers."""
        while time.monotonic() - self.started < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"Phoenix exited with {self.proc.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(self.url + "/healthz", timeout=2) as reply:
                    if reply.status == 200:
                        return time.monotonic() - self.started
            except OSError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"Phoenix did not answer /healthz in {timeout_s:.0f} s; see {self.log_path}")

    def spans(self, project: str) -> list[dict[str, Any]]:
        """Every span of `project`, through `GET /v1/projects/{project}/spans`, page by page."""
        found: list[dict[str, Any]] = []
        cursor: str | None = None
        while True:
            query = {"limit": "1000"} | ({"cursor": cursor} if cursor else {})
            url = f"{self.url}/v1/projects/{urllib.parse.quote(project)}/spans?{urllib.parse.urlencode(query)}"
            try:
                page = get_json(url)
            except urllib.error.HTTPError as err:
                if err.code == 404:  # the project appears with its first span
                    return []
                raise
            found += page["data"]
            cursor = page.get("next_cursor")
            if not cursor:
                return found

    def project_id(self, project: str) -> str:
        project_id: str = get_json(f"{self.url}/v1/projects/{urllib.parse.quote(project)}")["data"]["id"]
        return project_id

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


def ddtree(*args: str, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "ddtree.cli", *args], env=env, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise RuntimeError(f"ddtree {' '.join(args)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return done.stdout


def make_tiny_pair(root: Path) -> tuple[Path, Path]:
    target, drafter = root / "target", root / "drafter"
    ddtree("models", "init-tiny", "--out", str(target))
    ddtree("drafter", "init", "--target", str(target), "--out", str(drafter), "--block-size", "8")
    return target, drafter


def seconds(stamp: str) -> float:
    return datetime.fromisoformat(stamp).timestamp()


def check_steps(spans: list[dict[str, Any]], logged_steps: int, prompts: int) -> list[str]:
    """What is wrong with the spans Phoenix returned; empty when every step arrived with its four stages."""
    problems: list[str] = []
    steps = [s for s in spans if s["name"] == semconv.SPAN_STEP]
    requests = [s for s in spans if s["name"] == semconv.SPAN_REQUEST]
    if len(steps) != logged_steps:
        problems.append(f"{len(steps)} {semconv.SPAN_STEP} spans, the step log has {logged_steps} steps")
    if len(requests) != prompts:
        problems.append(f"{len(requests)} {semconv.SPAN_REQUEST} spans for {prompts} prompts")
    children: dict[str, list[dict[str, Any]]] = {}
    for span in spans:
        if span["parent_id"]:
            children.setdefault(span["parent_id"], []).append(span)
    for step in steps:
        index = step["attributes"].get(semconv.ATTR_STEP_INDEX)
        kids = sorted(children.get(step["context"]["span_id"], []), key=lambda s: seconds(s["start_time"]))
        names = tuple(k["name"] for k in kids)
        if names != STAGE_SPANS:
            problems.append(f"step {index}: children {names}, expected {STAGE_SPANS}")
            continue
        start, end = seconds(step["start_time"]), seconds(step["end_time"])
        for kid in kids:
            if not start - 1e-6 <= seconds(kid["start_time"]) <= seconds(kid["end_time"]) <= end + 1e-6:
                problems.append(f"step {index}: {kid['name']} lies outside its step")
        for attr in (semconv.ATTR_METHOD, semconv.ATTR_BUDGET, semconv.ATTR_TREE_NODES, semconv.ATTR_ACCEPTED_TOKENS):
            if attr not in step["attributes"]:
                problems.append(f"step {index}: no {attr}")
    return problems


def screenshot(phoenix: Phoenix, project: str, step: dict[str, Any], out: Path) -> None:
    """Headless Chromium (Debian's `chromium`) on the trace page with the step span selected."""
    browser = next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
    if browser is None:
        raise RuntimeError("no chromium on PATH (Debian: apt-get install chromium)")
    query = urllib.parse.urlencode({"selectedSpanNodeId": step["id"]})
    url = f"{phoenix.url}/projects/{phoenix.project_id(project)}/traces/{step['context']['trace_id']}?{query}"
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ddtree-chromium-") as profile:
        done = subprocess.run(
            [
                browser,
                "--headless",
                "--no-sandbox",  # Chromium refuses to run as root otherwise
                "--disable-gpu",
                "--hide-scrollbars",
                f"--user-data-dir={profile}",
                "--window-size=1500,900",  # wide enough for the trace tree to show each span's time
                "--virtual-time-budget=15000",  # let the single-page app fetch and draw the trace
                f"--screenshot={out}",
                url,
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    if done.returncode != 0 or not out.is_file():
        raise RuntimeError(f"chromium exited {done.returncode}:\n{done.stderr[-3000:]}")
    print(f"screenshot: {out} ({out.stat().st_size // 1024} KB) of {url}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--phoenix-python",
        default=os.environ.get("DDTREE_PHOENIX_PYTHON") or str(DEFAULT_PHOENIX_PYTHON),
        help="a python with arize-phoenix installed (default: $DDTREE_PHOENIX_PYTHON or .venv-phoenix)",
    )
    parser.add_argument("--model", help="target directory (default: a random tiny pair made on the spot)")
    parser.add_argument("--drafter", help="drafter directory, with --model")
    parser.add_argument("--default-pair", action="store_true", help="the default pair (pulled on first use)")
    parser.add_argument("--prompts", type=int, default=2, help="prompts in the batch; with 2+, each step is a trace")
    parser.add_argument("--budget", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--protocol", choices=("http/protobuf", "grpc"), default="http/protobuf")
    parser.add_argument("--project", default="ddtree", help="Phoenix project the spans go to")
    parser.add_argument("--screenshot", type=Path, help="PNG of one decode step's trace in Phoenix's UI")
    parser.add_argument("--json", type=Path, help="write what was found as one JSON object")
    parser.add_argument("--keep", action="store_true", help="leave Phoenix running until Ctrl-C")
    args = parser.parse_args(argv)
    if not Path(args.phoenix_python).is_file():
        print(f"no python at {args.phoenix_python}: make setup-phoenix, or --phoenix-python", file=sys.stderr)
        return 2
    if bool(args.model) != bool(args.drafter) or (args.model and args.default_pair):
        parser.error("--model and --drafter go together, without --default-pair")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that Phoenix is stopped on the way out

    with tempfile.TemporaryDirectory(prefix="ddtree-phoenix-") as tmp:
        work = Path(tmp)
        phoenix = Phoenix(args.phoenix_python, work)
        try:
            if args.default_pair:
                pair: tuple[str, ...] = ()
            elif args.model:
                pair = ("--model", args.model, "--drafter", args.drafter)
            else:
                target, drafter = make_tiny_pair(work / "pair")
                pair = ("--model", str(target), "--drafter", str(drafter))
            print(f"phoenix up in {phoenix.wait_ready():.1f} s at {phoenix.url}")

            steps_log = work / "steps.jsonl"
            endpoint = phoenix.url if args.protocol == "http/protobuf" else f"http://127.0.0.1:{phoenix.grpc_port}"
            env = dict(os.environ)
            env.update(
                DDTREE_DEBUG_METRICS="1",
                OTEL_TRACES_EXPORTER="otlp",
                OTEL_EXPORTER_OTLP_PROTOCOL=args.protocol,
                OTEL_EXPORTER_OTLP_ENDPOINT=endpoint,
                OTEL_METRICS_EXPORTER="none",
                OTEL_RESOURCE_ATTRIBUTES=f"openinference.project.name={args.project}",  # Phoenix's project
                DDTREE_LOG_FILE=str(steps_log),
            )
            prompts = [a for p in (PROMPTS * args.prompts)[: args.prompts] for a in ("--prompt", p)]
            started = time.monotonic()
            ddtree(
                "generate",
                *pair,
                "--method",
                "ddtree",
                *("--budget", str(args.budget), "--max-new-tokens", str(args.max_new_tokens), *prompts),
                env=env,
            )
            print(f"ddtree generate: {time.monotonic() - started:.1f} s, spans over OTLP {args.protocol}")
            logged = [json.loads(line) for line in steps_log.read_text().splitlines() if line.startswith("{")]
            logged_steps = sum(1 for line in logged if line.get("event") == semconv.SPAN_STEP)

            deadline, spans = time.monotonic() + 60, []
            while time.monotonic() < deadline:
                spans = phoenix.spans(args.project)
                if sum(s["name"] == semconv.SPAN_STEP for s in spans) >= logged_steps and not check_steps(
                    spans, logged_steps, args.prompts
                ):
                    break
                time.sleep(1)
            problems = check_steps(spans, logged_steps, args.prompts)
            counts: dict[str, int] = {}
            for span in spans:
                counts[span["name"]] = counts.get(span["name"], 0) + 1
            print(f"read back from {phoenix.url}/v1/projects/{args.project}/spans: {len(spans)} spans {counts}")
            print(f"step log: {logged_steps} steps")
            steps = sorted(
                (s for s in spans if s["name"] == semconv.SPAN_STEP),
                key=lambda s: int(s["attributes"].get(semconv.ATTR_STEP_INDEX, 0)),
            )
            if steps:
                one = steps[len(steps) // 2]
                kids = sorted(
                    (s for s in spans if s["parent_id"] == one["context"]["span_id"]),
                    key=lambda s: seconds(s["start_time"]),
                )
                stages = ", ".join(
                    f"{k['name']} {1000 * (seconds(k['end_time']) - seconds(k['start_time'])):.2f} ms" for k in kids
                )
                print(
                    f"step {one['attributes'].get(semconv.ATTR_STEP_INDEX)} (trace {one['context']['trace_id']}): "
                    f"{stages}"
                )
                if args.screenshot and not problems:
                    screenshot(phoenix, args.project, one, args.screenshot)
            if args.json:
                summary = {"spans": counts, "logged_steps": logged_steps, "problems": problems}
                args.json.write_text(json.dumps(summary, indent=1) + "\n")
            for problem in problems:
                print(f"problem: {problem}", file=sys.stderr)
            print("ok: every step arrived with its four stages" if not problems else "FAILED")
            if args.keep:
                print(f"Phoenix at {phoenix.url} until Ctrl-C")
                with contextlib.suppress(KeyboardInterrupt):
                    phoenix.proc.wait()
            return 0 if not problems else 1
        finally:
            phoenix.stop()


if __name__ == "__main__":
    sys.exit(main())
