"""What the benchmarks that start a cluster by hand share (bench/distributed_ctr.py,
bench/scale_bench.py): waiting for a daemon's --port_file and reading a Prometheus endpoint.
Python 3 standard library only."""
import os
import re
import time
import urllib.request


def wait_file(path, seconds=30):
    """The stripped contents of `path` once it exists and is not empty; exits after `seconds`."""
    end = time.time() + seconds
    while time.time() < end:
        if os.path.exists(path) and os.path.getsize(path) > 0:
            with open(path) as f:
                return f.read().strip()
        time.sleep(0.05)
    raise SystemExit(f"{path} did not appear within {seconds} s")


def metrics(port):
    """Every sample of http://127.0.0.1:PORT/metrics, summed over its labels, by family name."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        m = re.match(r"^([a-z_]+)(\{[^}]*\})?\s+([0-9.eE+-]+)$", line)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out
