"""Served against the engine in the same slots: the README's table from `gpu_bench.sh`'s served steps.

    python benchmarks/served_table.py ENGINE_ROWS.json[,MORE_ROWS.json] SERVED.json [LABEL=METHOD ...]

ENGINE_ROWS is `ddtree bench --continuous --out` (rows by batch size and method; several files, comma-separated,
where the slot counts were benched on different prompt sets), SERVED `bench_serve.py --out`
(loads by server label and clients). Each server label is matched to its engine row: `ar` to ar, `B=N` to
ddtree at budget N, `auto` to the schedule's row, or as LABEL=METHOD says (METHOD as the engine row's label:
`ar`, `ddtree B=16`, `auto`). Prints one markdown row per load: tokens/s served, by the engine, and their
ratio; then the TTFT p99 of each load, with the server's own mean TTFT where it was measured.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def engine_label(row: dict[str, Any]) -> str:
    if row["method"] == "ar":
        return "ar"
    if row.get("budget") in (None, "auto") or row["method"] == "auto":
        return "auto"
    return f"{row['method']} B={row['budget']}"


def default_match(label: str) -> str:
    if label.startswith("B="):
        return f"ddtree B={label.removeprefix('B=')}"
    return label


def main(argv: list[str]) -> int:
    engine = [row for name in argv[0].split(",") for row in json.loads(Path(name).read_text())]
    served = json.loads(Path(argv[1]).read_text())
    match = dict(tuple(arg.split("=", 1)) for arg in argv[2:])
    rows = {(engine_label(r), int(r["batch_size"])): float(r["tokens_per_second"]) for r in engine}
    labels = list(dict.fromkeys(s["server"] for s in served))
    print("| clients / slots | " + " | ".join(f"{label}: served / engine" for label in labels) + " |")
    print("|---" * (len(labels) + 1) + "|")
    for clients in sorted({int(s["clients"]) for s in served}):
        cells = []
        for label in labels:
            load = next(s for s in served if s["server"] == label and int(s["clients"]) == clients)
            alone = rows.get((match.get(label, default_match(label)), clients))
            ratio = f" = **{load['out_tok_per_s'] / alone:.2f}x**" if alone else ""
            cells.append(f"{load['out_tok_per_s']:.0f} / {alone or float('nan'):.0f}{ratio}")
        print(f"| {clients} | " + " | ".join(cells) + " |")
    for s in served:
        own = f" (server's mean {s['server_ttft_mean_ms']:.1f} ms)" if "server_ttft_mean_ms" in s else ""
        print(f"{s['server']}, {s['clients']} clients: TTFT p99 {s['ttft_p99_ms']:.1f} ms{own}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
