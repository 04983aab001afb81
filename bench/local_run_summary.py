#!/usr/bin/env python3
"""One JSON line that sums up a training run's `--output json` lines.

Reads what `tessera local --output json` (or build/bin/slow_link_benchmark, which adds a "link"
line) printed: the job's events, its final record and the link counters. Prints the run's state,
steps, samples per second and seconds, the seconds from the job's start to the first evaluation
at or above --target test accuracy (null when none reached it), the final test accuracy, the
distinct test accuracies in the order they were scored, the mean step times by phase, and, with
a link line, the bytes that crossed the shards' links per worker step in each direction. Each
--label KEY=VALUE goes first in the line (a VALUE that is a number as a number).

Used by bench/e2e_bench.sh and bench/slow_link_bench.sh:
    bench/local_run_summary.py RUN.out --target 0.85 --workers 2 --label round=1
"""
import argparse
import json
import sys


def label_value(text):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("output", help="the file the run's stdout went to")
    ap.add_argument("--target", type=float, default=0.85, help="test accuracy to time (0.85)")
    ap.add_argument("--workers", type=int, default=2, help="workers of the run, for per-step bytes")
    ap.add_argument("--label", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()

    events, record, link = [], None, None
    with open(args.output) as f:
        for line in f:
            line = line.strip()
            if not line.startswith("{"):
                continue
            d = json.loads(line)
            if "event" in d:
                events.append(d["event"])
            elif "link" in d:
                link = d["link"]
            elif "id" in d or "state_name" in d:
                record = d
    if record is None:
        sys.exit(f"{args.output}: no final record (the run failed; see its stderr)")
    start = int(record.get("start_time_ms", 0))
    to_target, evals = None, []
    for e in events:
        if not e.get("evaluated"):
            continue
        accuracy = round(e["test_accuracy"], 4)
        if not evals or evals[-1] != accuracy:
            evals.append(accuracy)
        if to_target is None and e["test_accuracy"] >= args.target:
            to_target = (int(e["time_ms"]) - start) / 1000.0
    summary = {}
    for item in args.label:
        key, _, value = item.partition("=")
        summary[key] = label_value(value)
    st = record.get("step_times", {})
    # round_trip and gate_wait only where the build reports them (issue #17's breakdown); JSON
    # leaves out a zero, so with a round trip an absent gate wait is 0.
    phases = ["compute", "exchange", "install", "data"]
    if "round_trip" in st:
        phases += ["round_trip", "gate_wait"]
    summary.update({
        "state": record.get("state_name"), "steps": record.get("steps"),
        "samples_per_second": record.get("samples_per_second"),
        "seconds": (int(record.get("end_time_ms", 0)) - start) / 1000.0,
        "time_to_target": to_target, "test_accuracy": record.get("test_accuracy"),
        "evaluations": evals,
        "step_times": {k: st.get(k, 0.0) for k in phases}})
    if link is not None:
        worker_steps = max(int(record.get("steps", 0)) * args.workers, 1)
        summary.update({
            "bytes_to_shards_per_step": link["bytes_to_shards"] / worker_steps,
            "bytes_from_shards_per_step": link["bytes_from_shards"] / worker_steps,
            "rate_mbit": link["rate_mbit"]})
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
