#!/usr/bin/env python3
"""A model of BSP scaling fitted to bench/scale_bench.py's measurements (issue #17 "Scale").

Reads the JSON lines of one scale_bench run (a narrow and a wide model, several worker counts)
and does three things:

1. Fits, on the runs with N <= --fit_max workers only, how each part's CPU per BSP step grows
   with N: the shards' S(N) = s0 + s1 * N, the workers' per-worker W(N) = w0 + w1 * N (on these
   2 cores a waiting worker's wake-ups cost more as more processes share them), and the
   coordinator's CPU per second C = c0 + c1 * N (its work is per progress report and heartbeat,
   not per step). The shards' cost of one byte, c_byte, comes from the pushpull lines (4 MiB
   partitions, where bytes dominate); the cost of one partition a worker pushes and pulls,
   c_part, from each width's s1 less its bytes' share:
       s1 = partitions * c_part + bytes_per_worker_step * c_byte

2. Checks the fit on the runs it did not see (N > --fit_max): on this machine every process
   shares `--cores` cores, so the predicted step is the CPU of all of them over the cores,
   max(step at N = 1, (N * W(N) + S(N)) / (cores - C)), printed beside the measured step and
   the shards' CPU.

3. Predicts the efficiency of a cluster with one host per worker and per shard, at 64 to 256
   workers on 25 and 100 Gbit/s links. A BSP step is the worker's compute, then the exchange:
   its push and its pull (a link carries a worker's M bytes, and a shard's N * M / S, at the
   link's rate), the shard's work over its cores, and the round trip measured at N = 1 (the
   step less the compute and the shards' CPU):
       T(N) = t_compute + 2 * max(M, N * M / S) / B
              + max(w / min(shard_cores, parts_per_shard), N * w / shard_cores) + t_rtt,  w = parts_per_shard * c_part
              + 2 * M / S * c_byte (a shard's work for one worker)
   Efficiency is t_compute / T(N) (BytePS's definition: N workers' speed over N times one
   worker's without communication), and, for what layer-by-layer overlap (not built) could give
   at best (an upper bound), t_compute / max(t_compute, T(N) - t_compute). Workloads: the measured logistic
   regression (its compute from the standalone run), and bert-large, BytePS's published setting
   (BERT-large, 340M parameters, fp16 gradients, batch 64 per V100, 8 GPUs per host reduced
   locally, so 256 GPUs are 32 worker hosts; --compute_ms is a host's compute per step, 340 ms
   by default, from NVIDIA's published ~190 sequences/s per V100 at sequence length 128), set
   beside BytePS's ~90% at 256 GPUs (its README, 100 Gbit/s RDMA, as many servers as workers).

  bench/scale_bench.py > /tmp/scale.jsonl && bench/scaling_model.py /tmp/scale.jsonl

Prints text tables, or one JSON object with --output json. Python 3 standard library only.
"""
import argparse
import json
import sys


def linear_fit(xs, ys):
    """Least squares y = a + b x."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def fit(lines, fit_max):
    """Per width: the linear fits of the shards, the workers and the coordinator."""
    widths = sorted(set(l["features"] for l in lines))
    fits = {}
    for d in widths:
        runs = sorted((l for l in lines if l["features"] == d and l["workers"] <= fit_max),
                      key=lambda l: l["workers"])
        if len(runs) < 2:
            raise SystemExit(f"features {d}: need at least 2 runs with N <= {fit_max}")
        ns = [l["workers"] for l in runs]
        s0, s1 = linear_fit(ns, [l["shard_cpu_ms"] for l in runs])
        w0, w1 = linear_fit(ns, [l["worker_cpu_ms"] / l["workers"] for l in runs])
        per_second = [l.get("coordinator_cpu_per_second",
                            l["coordinator_cpu_ms"] / l["step_ms"]) for l in runs]
        c0, c1 = linear_fit(ns, per_second)
        one = runs[0]
        fits[d] = {
            "s0_ms": s0, "s1_ms": s1, "w0_ms": w0, "w1_ms": w1, "c0": c0, "c1": c1,
            "bytes_per_worker_step": one["bytes_per_step"] / one["workers"],
            "partitions": round(one["partition_updates_per_step"]),
            "standalone_step_ms": one.get("standalone_step_ms"),
            # The step at N = 1 beyond its CPU: the round trip nothing else hides.
            "step1_ms": one["step_ms"] if one["workers"] == 1 else None,
        }
    return widths, fits


def solve_costs(widths, fits, pushpull):
    """c_byte (ms per byte) from the largest pushpull line; c_part (ms per partition a worker
    pushes and pulls in a step) from each width's s1 less its bytes' share."""
    if not pushpull:
        raise SystemExit("no pushpull line: run scale_bench.py with --pushpull_bytes")
    c_byte = max(pushpull, key=lambda l: l["bytes"])["shard_cpu_ns_per_byte"] * 1e-6
    per_width = {}
    for d in widths:
        f = fits[d]
        per_width[d] = max(0.0, f["s1_ms"] - f["bytes_per_worker_step"] * c_byte) / f["partitions"]
    return sum(per_width.values()) / len(per_width), c_byte, per_width


def check(lines, fits, fit_max, cores):
    rows = []
    for l in sorted(lines, key=lambda l: (l["features"], l["workers"])):
        f, n = fits[l["features"]], l["workers"]
        shards = f["s0_ms"] + f["s1_ms"] * n
        workers = n * (f["w0_ms"] + f["w1_ms"] * n)
        coordinator_per_second = f["c0"] + f["c1"] * n
        # The step solves T = (workers + shards + coordinator_per_second * T) / cores.
        cpu_bound = (workers + shards) / max(cores - coordinator_per_second, 1e-6)
        predicted = max(f["step1_ms"] or 0.0, cpu_bound)
        rows.append({
            "features": l["features"], "workers": n, "fitted": n <= fit_max,
            "step_ms": l["step_ms"], "predicted_step_ms": round(predicted, 3),
            "step_error": round(predicted / l["step_ms"] - 1.0, 3),
            "shard_cpu_ms": l["shard_cpu_ms"], "predicted_shard_cpu_ms": round(shards, 3),
            "shard_error": round(shards / l["shard_cpu_ms"] - 1.0, 3),
        })
    return rows


def cluster(model_bytes, compute_ms, round_trip_ms, c_part, c_byte, workers, gbits, shards,
            shard_cores, partition_bytes):
    """One BSP step's milliseconds on a cluster of `workers` hosts and `shards` shard hosts,
    without overlap and with an ideal one (compute hides all of the exchange it can)."""
    link = gbits * 1e9 / 8 / 1000.0  # bytes per ms
    per_shard = model_bytes / shards
    parts_per_shard = max(1.0, model_bytes / partition_bytes / shards)
    transfer = max(model_bytes / link, workers * per_shard / link)
    one_worker = parts_per_shard * c_part + 2 * per_shard * c_byte  # a shard's work for one
    # The measured round trip holds one worker's shard work for a small model; what more workers
    # add queues on the shard's cores.
    # One worker's partitions are updated in parallel, up to one per core.
    shard_cpu = max(one_worker / min(shard_cores, parts_per_shard),
                    workers * one_worker / shard_cores)
    exchange = 2 * transfer + shard_cpu + round_trip_ms
    step = compute_ms + exchange
    overlapped = max(compute_ms, exchange)
    return step, compute_ms / step, compute_ms / overlapped


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("lines", help="bench/scale_bench.py's output (- for stdin)")
    ap.add_argument("--fit_max", type=int, default=8, help="fit on the runs with N <= this")
    ap.add_argument("--cores", type=float, default=2.0, help="cores of the measuring machine")
    ap.add_argument("--shard_cores", type=float, default=16.0,
                    help="cores a shard host gives its RPC and update threads")
    ap.add_argument("--shards_per_worker", type=float, default=1.0,
                    help="shard hosts per worker host (BytePS: as many servers as workers)")
    ap.add_argument("--compute_ms", type=float, default=340.0,
                    help="bert-large: one host's compute per step (8 V100s, batch 64 each)")
    ap.add_argument("--partition_bytes", type=int, default=4096,
                    help="the measured model's partition size (scale_bench.py's)")
    ap.add_argument("--output", choices=["text", "json"], default="text")
    args = ap.parse_args()
    src = sys.stdin if args.lines == "-" else open(args.lines)
    everything = [json.loads(l) for l in src if l.startswith("{")]
    lines = [l for l in everything if l.get("kind") != "pushpull"]
    pushpull = [l for l in everything if l.get("kind") == "pushpull"]
    widths, fits = fit(lines, args.fit_max)
    c_part, c_byte, c_part_by_width = solve_costs(widths, fits, pushpull)
    checked = check(lines, fits, args.fit_max, args.cores)
    narrow = fits[widths[0]]
    # The round trip of a step with nothing to wait for: the narrow model's wall step at N = 1
    # less its compute (client, loopback stack and shard, less the shard's own work).
    round_trip = max(0.0, (narrow["step1_ms"] or 0.0) - (narrow["standalone_step_ms"] or 0.0) -
                     narrow["partitions"] * c_part)
    wide = fits[widths[-1]]
    workloads = {
        # The measured model: its weights, and its compute from the standalone run.
        f"logistic-{widths[-1]}": (4 * (widths[-1] + 1), wide["standalone_step_ms"] or 0.0,
                                   args.partition_bytes),
        "bert-large": (2 * 340e6, args.compute_ms, 4 << 20),
    }
    predictions = []
    for name, (model_bytes, compute_ms, partition_bytes) in workloads.items():
        for gbits in (25, 100):
            for n in (1, 64, 128, 256):
                hosts = max(1, n // 8) if name == "bert-large" else n
                shards = max(1, round(hosts * args.shards_per_worker))
                step, eff, eff_overlap = cluster(model_bytes, compute_ms, round_trip, c_part,
                                                 c_byte, hosts, gbits, shards, args.shard_cores,
                                                 partition_bytes)
                predictions.append({"workload": name, "gbits": gbits, "workers": n,
                                    "worker_hosts": hosts, "shard_hosts": shards,
                                    "step_ms": round(step, 3), "efficiency": round(eff, 3),
                                    "efficiency_with_overlap": round(eff_overlap, 3)})
    # The coordinator's share of a core at each worker count, from its fit on the widest model.
    coordinator = {n: round(wide["c0"] + wide["c1"] * n, 4) for n in (32, 64, 128, 256)}
    result = {"costs": {"c_part_us": round(1000 * c_part, 3),
                        "c_part_us_by_width": {str(d): round(1000 * v, 3)
                                               for d, v in c_part_by_width.items()},
                        "c_byte_ns": round(1e6 * c_byte, 4),
                        "round_trip_us": round(1000 * round_trip, 1)},
              "fits": {str(d): {k: (round(v, 6) if isinstance(v, float) else v)
                                for k, v in f.items()} for d, f in fits.items()},
              "check": checked, "coordinator_cores": coordinator, "cluster": predictions}
    if args.output == "json":
        print(json.dumps(result))
        return
    print(f"shard cost per partition exchanged {result['costs']['c_part_us']} us (by width "
          f"{result['costs']['c_part_us_by_width']}), per byte {result['costs']['c_byte_ns']} "
          f"ns; round trip at N = 1 {result['costs']['round_trip_us']} us")
    print("\ncheck on this machine (fitted on N <= %d):" % args.fit_max)
    print("features workers fitted  step_ms predicted error  shard_ms predicted error")
    for r in checked:
        print(f"{r['features']:8d} {r['workers']:7d} {str(r['fitted']):6s} {r['step_ms']:8.3f} "
              f"{r['predicted_step_ms']:9.3f} {r['step_error']:+5.0%} {r['shard_cpu_ms']:9.3f} "
              f"{r['predicted_shard_cpu_ms']:9.3f} {r['shard_error']:+5.0%}")
    print("\ncoordinator cores busy by workers:", coordinator)
    print("\ncluster (a host per worker and per shard):")
    print("workload        Gbit/s workers hosts shards  step_ms efficiency  with overlap")
    for p in predictions:
        print(f"{p['workload']:15s} {p['gbits']:6d} {p['workers']:7d} {p['worker_hosts']:5d} "
              f"{p['shard_hosts']:6d} {p['step_ms']:8.2f} {p['efficiency']:10.1%} "
              f"{p['efficiency_with_overlap']:12.1%}")


if __name__ == "__main__":
    main()
