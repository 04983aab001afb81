#!/usr/bin/env python3
"""Distributed click-through benchmark (issue #15): a cluster started by hand, as an operator would.

Starts tessera-coordinator, 2 tessera-server shards (each with its Prometheus endpoint) and
2 tessera-worker daemons on loopback ports picked at run time, submits one job
(examples/criteo_dlrm.textproto by default) with `tessera submit --watch`, and prints one JSON
line: the job's samples per second, the test AUC after each epoch with the seconds since the
job started when it was reached, and the bytes the shards moved per step (pushed gradient bytes
and pulled weight bytes, from tessera_shard_pushed_bytes_total and
tessera_shard_pulled_bytes_total, over both shards, divided by the steps) beside what a dense
exchange of the same model would move: every worker pushing and pulling every table row the
shards hold at the end and every dense parameter, each step (counted in the job's export).

  bench/distributed_ctr.py --job examples/criteo_dlrm.textproto --epochs 2

The capacity run (a table of 10^7 rows of width 16 over two shards): data whose ids spread over
more of each vocabulary, the hashed model on it, no export (the rows held come from
tessera_shard_table_rows), and each shard's peak resident memory and bytes per row:

  tessera datagen criteo --rows 4000000 --zipf 0.6 --out /var/tmp/tessera-criteo-flat
  bench/distributed_ctr.py --job examples/criteo_hashed.textproto \
      --data /var/tmp/tessera-criteo-flat --no_export

The fill of a replicated shard (issue #16, docs/reliability.md "Filling a new copy"): the job
with `replication: 2`, shard 1 SIGKILLed at a step, restarted on a new port with its data
directory, and filled from shard 0 while the job trains; adds what the coordinator and the
filled shard logged of it (steps, bytes, seconds of each part):

  bench/distributed_ctr.py --job examples/criteo_hashed.textproto \
      --data /var/tmp/tessera-criteo-flat --no_export --fill_at_step 3000

Needs the built binaries (build/bin) and the generated data the job names
(`tessera datagen criteo --rows 1000000 --out /var/tmp/tessera-criteo`). Python 3 standard
library only.
"""
import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from hand_cluster import metrics, wait_file


def get_job(args, coordinator):
    r = subprocess.run([f"{args.bin}/tessera", "list", "--coordinator", coordinator, "--output",
                        "json"], capture_output=True, text=True, timeout=60)
    listed = [json.loads(l) for l in r.stdout.splitlines() if l.startswith("{")]
    jobs = listed[-1].get("jobs", []) if listed else []
    return jobs[-1] if jobs else None


def fill_shard(args, coordinator, tmp, shard_procs, procs, shard_argv, start, metric_ports):
    """SIGKILLs shard 1 at --fill_at_step, restarts it and waits for its fill (bounded)."""
    end = time.time() + 1800
    job = None
    while time.time() < end:
        job = get_job(args, coordinator)
        if job and int(job.get("step", 0)) >= args.fill_at_step:
            break
        time.sleep(0.2)
    else:
        raise SystemExit(f"the job did not reach step {args.fill_at_step}")
    shard_procs[1].kill()
    shard_procs[1].wait()
    killed = time.time()
    while time.time() < end and not (get_job(args, coordinator) or {}).get("down_shards"):
        time.sleep(0.1)
    os.remove(f"{tmp}/shard-1.port")
    os.remove(f"{tmp}/shard-1.metrics")
    start("shard-1-again", shard_argv(1))
    shard_procs[1] = procs[-1]
    metric_ports[1] = wait_file(f"{tmp}/shard-1.metrics")
    restarted = time.time()
    # The job's step every 0.1 s until the shard holds its copies again: whether the ranks train
    # on while it is filled, and the longest time the step stood still.
    samples = []
    while time.time() < end:
        job = get_job(args, coordinator)
        samples.append((time.time(), int(job.get("step", 0))))
        if not job.get("down_shards") or job.get("state") != "JOB_STATE_RUNNING":
            break
        time.sleep(0.1)
    filled = time.time()
    longest_still, since = 0.0, samples[0]
    for t, step in samples[1:]:
        if step != since[1]:
            since = (t, step)
        longest_still = max(longest_still, t - since[0])
    # The coordinator's and the filled shard's words on it, from their logs.
    said = []
    for name in ("coordinator", "shard-1-again"):
        with open(os.path.join(tmp, name + ".log")) as f:
            said += re.findall(r"\] (?:coordinator: job [^:]+: )?((?:shard 1 \(|shard 1 serves|"
                               r"shard 1 installed|shard 1: job|shard 1 keeps|the snapshots)[^\n]*)", f.read())
    return {"killed_at_step": args.fill_at_step,
            "seconds_to_failover_seen": round(restarted - killed, 2),
            "seconds_from_restart_to_filled_seen": round(filled - restarted, 2),
            "steps_from_restart_to_filled": samples[-1][1] - samples[0][1],
            "longest_seconds_without_a_step_while_filled": round(longest_still, 2),
            "logs": said}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--job", default="examples/criteo_dlrm.textproto")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--consistency", help="override the job's (bsp, ssp, asp, hybrid)")
    ap.add_argument("--staleness", type=int, default=0)
    ap.add_argument("--bin", default="build/bin")
    ap.add_argument("--threads", type=int, default=1, help="per worker")
    ap.add_argument("--data", help="read train.tsv and test.tsv from this folder instead")
    ap.add_argument("--no_export", action="store_true",
                    help="count the table rows from the shards' metrics, skip the export and the "
                         "dense-exchange comparison")
    ap.add_argument("--fill_at_step", type=int, default=0,
                    help="replication 2; SIGKILL shard 1 at this step, restart it and measure its fill")
    ap.add_argument("--keep_logs", action="store_true", help="keep the daemons' logs (printed)")
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="tessera-bench-ctr-")
    procs = []
    try:
        spec = open(args.job).read()
        spec = re.sub(r"(?m)^epochs: \d+", f"epochs: {args.epochs}", spec)
        if args.consistency:
            spec = re.sub(r'(?m)^consistency: "[a-z]+"', f'consistency: "{args.consistency}"', spec)
            if args.staleness:
                spec += f"\nstaleness: {args.staleness}\n"
        if args.fill_at_step:
            spec += "\nreplication: 2\n"
        if args.data:
            spec = re.sub(r'train_path: "[^"]+"', f'train_path: "{args.data}/train.tsv"', spec)
            spec = re.sub(r'test_path: "[^"]+"', f'test_path: "{args.data}/test.tsv"', spec)
        data_dirs = sorted(set(os.path.dirname(p) for p in re.findall(r'_path: "([^"]+)"', spec)))
        job_path = os.path.join(tmp, "job.textproto")
        with open(job_path, "w") as f:
            f.write(spec)

        def start(name, argv):
            log = open(os.path.join(tmp, name + ".log"), "w")
            procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))

        roots = [f"--dataset_root={d}" for d in data_dirs]
        start("coordinator", [f"{args.bin}/tessera-coordinator", "--listen", "127.0.0.1:0",
                              "--port_file", f"{tmp}/coordinator.port", "--data_dir",
                              f"{tmp}/coordinator", "--num_shards", "2", *roots])
        coordinator = "127.0.0.1:" + wait_file(f"{tmp}/coordinator.port")
        metric_ports = []
        shard_procs = []

        def shard_argv(i):
            argv = [f"{args.bin}/tessera-server", "--listen", "127.0.0.1:0",
                    "--port_file", f"{tmp}/shard-{i}.port", "--coordinator",
                    coordinator, "--shard_index", str(i), "--metrics_listen",
                    "127.0.0.1:0", "--metrics_port_file", f"{tmp}/shard-{i}.metrics"]
            if args.fill_at_step:  # the snapshots a fill copies are files in the data directory
                argv += ["--data_dir", f"{tmp}/shard-{i}-data"]
            return argv

        for i in range(2):
            start(f"shard-{i}", shard_argv(i))
            shard_procs.append(procs[-1])
            metric_ports.append(wait_file(f"{tmp}/shard-{i}.metrics"))
        for i in range(2):
            start(f"worker-{i}", [f"{args.bin}/tessera-worker", "--coordinator", coordinator,
                                  "--threads", str(args.threads), "--hostname", f"bench-{i}",
                                  *roots])
        time.sleep(2)  # registrations
        start_time = time.time()
        watcher = subprocess.Popen([f"{args.bin}/tessera", "submit", job_path, "--watch",
                                    "--coordinator", coordinator, "--output", "json"],
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        fill = fill_shard(args, coordinator, tmp, shard_procs, procs, shard_argv, start,
                          metric_ports) if args.fill_at_step else None
        out, err = watcher.communicate(timeout=3600)
        watch = subprocess.CompletedProcess(watcher.args, watcher.returncode, out, err)
        lines = [l for l in watch.stdout.splitlines() if l.startswith("{")]
        if watch.returncode != 0 or not lines:
            sys.stderr.write(watch.stdout + watch.stderr)
            raise SystemExit(f"the job did not succeed (exit {watch.returncode})")
        job = json.loads(lines[-1])
        events = [json.loads(l)["event"] for l in lines if l.startswith('{"event":')]
        started = min((int(e["time_ms"]) for e in events), default=0)
        epochs = [{"epoch": int(e.get("epoch", 0)), "test_auc": round(e["test_auc"], 4),
                   "seconds": round((int(e["time_ms"]) - started) / 1000.0, 1)}
                  for e in events if e.get("evaluated") and "test_auc" in e]
        totals = {}
        for port in metric_ports:
            for k, v in metrics(port).items():
                totals[k] = totals.get(k, 0.0) + v
        steps = int(job.get("step", 0))
        moved = totals.get("tessera_shard_pushed_bytes_total", 0) + \
            totals.get("tessera_shard_pulled_bytes_total", 0)
        result = {
            "job": job.get("spec", {}).get("name"), "consistency": args.consistency or "as spec",
            "workers": 2, "shards": 2, "steps": steps,
            "samples_per_second": round(float(job.get("samples_per_second", 0)), 1),
            "wall_seconds": round(time.time() - start_time, 1),
            "test_auc": job.get("test_auc"), "epochs": epochs,
            "bytes_per_step": round(moved / max(steps, 1)),
            "table_rows_on_shards": int(totals.get("tessera_shard_table_rows", 0)),
            "rows_admitted": int(totals.get("tessera_shard_table_rows_admitted_total", 0)),
            "rows_evicted": int(totals.get("tessera_shard_table_rows_evicted_total", 0)),
        }
        # Each shard's peak resident memory, and over both the bytes per row held.
        peaks = []
        for p in shard_procs:
            with open(f"/proc/{p.pid}/status") as f:
                peaks.append(int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) * 1024)
        result["shard_peak_rss_bytes"] = peaks
        if fill:
            result["fill"] = fill
        if result["table_rows_on_shards"]:
            result["peak_rss_bytes_per_row"] = round(sum(peaks) / result["table_rows_on_shards"], 1)
        if args.no_export:
            print(json.dumps(result))
            return
        # What the model holds, from its export: table rows (".ids" tensors) and float values.
        exported = os.path.join(tmp, "model.safetensors")
        subprocess.run([f"{args.bin}/tessera", "export", job["id"], "--coordinator", coordinator,
                        "--out", exported], check=True, capture_output=True, timeout=600)
        with open(exported, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        rows = sum(t["shape"][0] for name, t in header.items() if name.endswith(".ids"))
        values = sum(math.prod(t["shape"]) for t in header.values() if t["dtype"] == "F32")
        # A dense exchange: each of the 2 workers pushes and pulls every value, every step.
        dense_exchange = 2 * 2 * 4 * values
        result.update({
            "table_rows_at_end": int(rows),
            "dense_exchange_bytes_per_step": round(dense_exchange),
            "fraction_of_dense_exchange": round(moved / max(steps, 1) / max(dense_exchange, 1), 5),
        })
        print(json.dumps(result))
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


if __name__ == "__main__":
    main()
