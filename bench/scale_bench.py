#!/usr/bin/env python3
"""How a BSP step costs as workers grow (issue #17 "Scale"): 1 to 32 worker processes, 4 shards.

For each model width and worker count N it starts a fresh cluster by hand on loopback ports
picked at run time (tessera-coordinator, 4 tessera-server shards, N tessera-worker daemons with
1 thread each), submits a logistic regression (one dense unit, sigmoid cross-entropy, SGD, BSP)
on a CSV it generates from a planted logistic model, and samples every 0.25 s: the shards'
updates (tessera_shard_updates_applied_total), and the CPU seconds (/proc/PID/stat, user +
system) of the shards, the coordinator and the workers. From the middle 80% of the steps it
prints one JSON line per run:

  step_ms               wall milliseconds per BSP step
  shard_cpu_ms          CPU milliseconds of the 4 shards together per step
  coordinator_cpu_ms    CPU milliseconds of the coordinator per step
  coordinator_cpu_per_second  the same per wall second: the coordinator's work is per progress
                        report (each rank every 0.5 s) and heartbeat, not per step
  worker_cpu_ms         CPU milliseconds of the N workers together per step
  bytes_per_step        gradient bytes pushed plus weight bytes pulled at the shards per step
  shards_used           shards that hold a partition of the model (placement by hash)
  cpu_per_sample_us     all of the above CPU per training example
  cpu_efficiency        cpu_per_sample_us at the first worker count over that at N: 1.0 when the
                        system's cost per example does not grow with the worker count
  test_accuracy         the final record's, beside the planted model's own on the test split
  standalone_step_ms    the same model's step in one process with no cluster (its compute)

Then, for the per-byte cost at sizes where bytes dominate, one line per --pushpull_bytes size
from `tessera-bench pushpull` (1 shard, 1 client): the shard's CPU nanoseconds per byte moved
(pushed plus pulled), read from /proc while it runs, beside the goodput and raw TCP's.

On this machine every process shares 2 cores, so the wall step time grows with N by CPU
sharing alone; the CPU per step is what a cluster with a host per process would see spread
over its hosts. bench/scaling_model.py fits per-message and per-byte costs to these lines.

  bench/scale_bench.py --workers 1,2,4,8,16,32 --features 32,4096 > /tmp/scale.jsonl

As a test (ctest tessera_scale_test): 16 and 32 workers, each job must succeed with its steps
and reach the planted model's test accuracy less 0.03:

  bench/scale_bench.py --workers 16,32 --features 32 --first_steps 300 --seconds 3 \
      --pushpull_bytes "" --check_accuracy 0.03

Needs the built binaries (build/bin). Python 3 standard library only.
"""
import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from hand_cluster import metrics, wait_file

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid):
    """User + system CPU seconds of a live process, 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def write_data(folder, features, rows, test_rows, seed):
    """A planted logistic model: x uniform in {-1, 0, 1}^D, P(y = 1) = sigmoid(w.x + b).

    Returns the planted model's accuracy on the test split (its Bayes-optimal decisions)."""
    rng = random.Random(seed)
    w = [rng.gauss(0.0, 1.0) * 2.0 / math.sqrt(features) for _ in range(features)]
    b = 0.25
    planted_correct = 0
    for name, count in (("train.csv", rows), ("test.csv", test_rows)):
        with open(os.path.join(folder, name), "w") as f:
            for _ in range(count):
                x = [rng.randint(-1, 1) for _ in range(features)]
                z = b + sum(wi * xi for wi, xi in zip(w, x))
                y = 1 if rng.random() < 1.0 / (1.0 + math.exp(-z)) else 0
                if name == "test.csv":
                    planted_correct += int((z > 0) == (y == 1))
                f.write(f"{y}," + ",".join(map(str, x)) + "\n")
    return planted_correct / test_rows


JOB = """name: "scale-lr"
model {{
  input_shape: [{features}]
  layers {{ dense {{ units: 1 }} }}
  loss: LOSS_SIGMOID_CROSS_ENTROPY
}}
dataset {{
  format: FORMAT_CSV
  train_path: "{data}/train.csv"
  test_path: "{data}/test.csv"
  label_column: 0
  num_classes: 2
}}
optimizer {{ kind: OPTIMIZER_KIND_SGD learning_rate: 0.1 }}
batch_size: {batch}
epochs: 100000
max_steps: {steps}
eval {{ every_epochs: 100000 }}
seed: 1
device: "cpu"
num_workers: {workers}
consistency: "bsp"
partition_bytes: {partition_bytes}
"""


class Sampler(threading.Thread):
    """Every `period` s: (time, shard updates, CPU seconds of shards, coordinator, workers)."""

    def __init__(self, metric_ports, groups, period=0.25):
        super().__init__(daemon=True)
        self.metric_ports, self.groups, self.period = metric_ports, groups, period
        self.samples, self.stop = [], threading.Event()

    def run(self):
        while not self.stop.is_set():
            try:
                totals = [metrics(p) for p in self.metric_ports]
            except OSError:
                break
            updates = sum(t.get("tessera_shard_updates_applied_total", 0.0) for t in totals)
            cpu = {k: sum(cpu_seconds(pid) for pid in pids) for k, pids in self.groups.items()}
            self.samples.append((time.time(), updates, cpu))
            self.stop.wait(self.period)


def run_one(args, data, features, workers, steps, planted_accuracy):
    tmp = tempfile.mkdtemp(prefix="tessera-scale-")
    procs = []

    def start(name, argv):
        log = open(os.path.join(tmp, name + ".log"), "w")
        procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))
        return procs[-1]

    try:
        job_path = os.path.join(tmp, "job.textproto")
        with open(job_path, "w") as f:
            f.write(JOB.format(features=features, data=data, batch=args.batch, steps=steps,
                               workers=workers, partition_bytes=args.partition_bytes))
        root = f"--dataset_root={data}"
        coord = start("coordinator", [
            f"{args.bin}/tessera-coordinator", "--listen", "127.0.0.1:0", "--port_file",
            f"{tmp}/coordinator.port", "--data_dir", f"{tmp}/coordinator", "--num_shards",
            str(args.shards), root])
        coordinator = "127.0.0.1:" + wait_file(f"{tmp}/coordinator.port", 60)
        shards, metric_ports = [], []
        for i in range(args.shards):
            shards.append(start(f"shard-{i}", [
                f"{args.bin}/tessera-server", "--listen", "127.0.0.1:0", "--port_file",
                f"{tmp}/shard-{i}.port", "--coordinator", coordinator, "--shard_index", str(i),
                "--metrics_listen", "127.0.0.1:0", "--metrics_port_file",
                f"{tmp}/shard-{i}.metrics"]))
            metric_ports.append(wait_file(f"{tmp}/shard-{i}.metrics", 60))
        worker_procs = [start(f"worker-{i}", [
            f"{args.bin}/tessera-worker", "--coordinator", coordinator, "--threads", "1",
            "--hostname", f"scale-{i}", root]) for i in range(workers)]
        # Every worker registered: `tessera cluster` lists them READY.
        end = time.time() + 120
        while time.time() < end:
            r = subprocess.run([f"{args.bin}/tessera", "cluster", "--coordinator", coordinator,
                                "--output", "json"], capture_output=True, text=True, timeout=60)
            if r.stdout.count('"MEMBER_STATE_READY"') >= workers + args.shards:
                break
            time.sleep(0.5)
        else:
            raise SystemExit(f"{workers} workers and {args.shards} shards did not register")
        sampler = Sampler(metric_ports, {"shards": [p.pid for p in shards],
                                         "coordinator": [coord.pid],
                                         "workers": [p.pid for p in worker_procs]})
        sampler.start()
        watch = subprocess.run([f"{args.bin}/tessera", "submit", job_path, "--watch",
                                "--coordinator", coordinator, "--output", "json"],
                               capture_output=True, text=True, timeout=args.timeout)
        sampler.stop.set()
        sampler.join()
        lines = [l for l in watch.stdout.splitlines() if l.startswith("{")]
        job = json.loads(lines[-1]) if lines else {}
        if watch.returncode != 0 or job.get("state") != "JOB_STATE_SUCCEEDED":
            sys.stderr.write(watch.stdout + watch.stderr)
            raise SystemExit(f"N={workers}: the job did not succeed (exit {watch.returncode})")
        steps = int(job["step"])
        totals, shards_used = {}, 0
        for port in metric_ports:
            scraped = metrics(port)
            shards_used += int(scraped.get("tessera_shard_pushed_bytes_total", 0.0) > 0)
            for k, v in scraped.items():
                totals[k] = totals.get(k, 0.0) + v
        updates_per_step = totals["tessera_shard_updates_applied_total"] / steps
        # The middle 80% of the steps: no registration, data loading or evaluation in it.
        s = sampler.samples
        lo = next(x for x in s if x[1] >= 0.1 * steps * updates_per_step)
        hi = [x for x in s if x[1] <= 0.9 * steps * updates_per_step][-1]
        window = (hi[1] - lo[1]) / updates_per_step
        if window < 0.25 * steps:
            raise SystemExit(f"N={workers}: too few samples ({len(s)}); raise --seconds")
        per_step = {k: 1000.0 * (hi[2][k] - lo[2][k]) / window for k in lo[2]}
        moved = totals.get("tessera_shard_pushed_bytes_total", 0.0) + \
            totals.get("tessera_shard_pulled_bytes_total", 0.0)
        cpu_ms = sum(per_step.values())
        return {
            "features": features, "workers": workers, "shards": args.shards,
            "batch": args.batch, "steps": steps, "window_steps": round(window),
            "step_ms": round(1000.0 * (hi[0] - lo[0]) / window, 3),
            "shard_cpu_ms": round(per_step["shards"], 3),
            "coordinator_cpu_ms": round(per_step["coordinator"], 4),
            "coordinator_cpu_per_second": round((hi[2]["coordinator"] - lo[2]["coordinator"]) /
                                                (hi[0] - lo[0]), 4),
            "worker_cpu_ms": round(per_step["workers"], 3),
            "bytes_per_step": round(moved / steps),
            "partition_updates_per_step": round(updates_per_step, 2),
            "shards_used": shards_used,
            "cpu_per_sample_us": round(1000.0 * cpu_ms / (workers * args.batch), 2),
            "test_accuracy": job.get("test_accuracy"),
            "planted_test_accuracy": round(planted_accuracy, 4),
        }
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
        if args.keep_logs:
            sys.stderr.write(f"logs kept in {tmp}\n")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def standalone_step_ms(args, data, features):
    """The model's own compute: one process, no cluster (tessera-worker --standalone, 1 thread)."""
    tmp = tempfile.mkdtemp(prefix="tessera-scale-alone-")
    try:
        job_path = os.path.join(tmp, "job.textproto")
        with open(job_path, "w") as f:
            f.write(JOB.format(features=features, data=data, batch=args.batch, steps=2000,
                               workers=1, partition_bytes=args.partition_bytes))
        r = subprocess.run([f"{args.bin}/tessera-worker", "--standalone", "--job", job_path,
                            "--threads", "1", "--output", "json"], capture_output=True,
                           text=True, timeout=600)
        out = [json.loads(l) for l in r.stdout.splitlines() if l.startswith("{")]
        if r.returncode != 0 or not out or "train_seconds" not in out[-1]:
            sys.stderr.write(r.stdout[-2000:] + r.stderr[-2000:])
            raise SystemExit("the standalone run failed")
        return 1000.0 * out[-1]["train_seconds"] / out[-1]["steps"]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def pushpull_costs(args, size):
    """The shard's CPU per byte moved: tessera-bench pushpull (1 shard, 1 client, 4 MiB
    partitions) with its tessera-server's CPU seconds read from /proc while it runs."""
    bench = subprocess.Popen([f"{args.bin}/tessera-bench", "pushpull", "--shards", "1",
                              "--clients", "1", "--bytes", size, "--seconds", "3", "--rounds",
                              "1", "--reference", "tcp", "--output", "json"],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    server_cpu, client_cpu = {}, 0.0
    while bench.poll() is None:
        children = subprocess.run(["pgrep", "-P", str(bench.pid)], capture_output=True,
                                  text=True).stdout.split()
        for pid in children:
            server_cpu[pid] = max(server_cpu.get(pid, 0.0), cpu_seconds(pid))
        client_cpu = max(client_cpu, cpu_seconds(bench.pid))
        time.sleep(0.05)
    lines = [json.loads(l) for l in bench.stdout.read().splitlines() if l.startswith("{")]
    if bench.returncode != 0 or not lines:
        raise SystemExit(f"tessera-bench pushpull --bytes {size} failed")
    r = lines[-1]
    moved = r["goodput_bytes_per_second"] * r["seconds"]
    return {"kind": "pushpull", "bytes": r["bytes"], "partition_bytes": r["partition_bytes"],
            "goodput_bytes_per_second": r["goodput_bytes_per_second"],
            "tcp_bytes_per_second": r["tcp_bytes_per_second"],
            "shard_cpu_ns_per_byte": round(1e9 * sum(server_cpu.values()) / moved, 4)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="1,2,4,8,16,32", help="worker counts, comma-separated")
    ap.add_argument("--features", default="32,4096",
                    help="model widths, comma-separated (fp32 weights of 4 * (D + 1) bytes)")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32, help="per worker")
    ap.add_argument("--seconds", type=float, default=8.0,
                    help="length of each run's training: its max_steps comes from the step time "
                         "of the previous run, scaled by the worker count")
    ap.add_argument("--first_steps", type=int, default=4000, help="max_steps of the first run")
    ap.add_argument("--partition_bytes", type=int, default=4096,
                    help="the job's partition_bytes: the wide model is cut into 4 partitions")
    ap.add_argument("--rows", type=int, default=0,
                    help="training rows (0: 4 batches per worker at the largest N)")
    ap.add_argument("--pushpull_bytes", default="4M,64M",
                    help="tensor sizes of the per-byte measurement (tessera-bench pushpull); "
                         "empty: none")
    ap.add_argument("--bin", default="build/bin")
    ap.add_argument("--timeout", type=int, default=1200, help="seconds per run at most")
    ap.add_argument("--keep_logs", action="store_true")
    ap.add_argument("--check_accuracy", type=float, default=None,
                    help="as a test: exit 1 unless every run's test accuracy is at least the "
                         "planted model's less this (ctest tessera_scale_test)")
    args = ap.parse_args()
    counts = [int(n) for n in args.workers.split(",")]
    widths = [int(d) for d in args.features.split(",")]
    if any(n < 1 or n > 64 for n in counts) or any(d < 1 for d in widths) or args.first_steps < 100:
        raise SystemExit("--workers in [1, 64], --features >= 1, --first_steps >= 100")
    rows = args.rows or 4 * args.batch * max(counts)
    data_root = tempfile.mkdtemp(prefix="tessera-scale-data-")
    failures = []
    try:
        for d in widths:
            data = os.path.join(data_root, f"d{d}")
            os.makedirs(data)
            planted = write_data(data, d, rows, 2000, seed=d)
            alone_ms = standalone_step_ms(args, data, d)
            base, prev = None, None
            for n in counts:
                steps = args.first_steps
                if prev:  # about --seconds at the previous run's step time, grown with N
                    steps = max(100, int(args.seconds * 1000.0 * prev["workers"] /
                                         (prev["step_ms"] * n)))
                line = prev = run_one(args, data, d, n, steps, planted)
                line["standalone_step_ms"] = round(alone_ms, 4)
                if args.check_accuracy is not None and line["steps"] != steps:
                    failures.append(f"N={n}: {line['steps']} steps, not {steps}")
                if args.check_accuracy is not None and (line["test_accuracy"] or 0.0) < \
                        planted - args.check_accuracy:
                    failures.append(f"N={n}, {d} features: test accuracy "
                                    f"{line['test_accuracy']} below the planted model's "
                                    f"{planted:.4f} less {args.check_accuracy}")
                if base is None:
                    base = line["cpu_per_sample_us"]
                line["cpu_efficiency"] = round(base / line["cpu_per_sample_us"], 3)
                print(json.dumps(line), flush=True)
        for size in filter(None, args.pushpull_bytes.split(",")):
            print(json.dumps(pushpull_costs(args, size)), flush=True)
    finally:
        shutil.rmtree(data_root, ignore_errors=True)
    if failures:
        raise SystemExit("FAILED: " + "; ".join(failures))


if __name__ == "__main__":
    main()
