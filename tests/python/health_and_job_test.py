#!/usr/bin/python3
"""A client that is not ours talks to a secured Tessera cluster (issue #5).

Starts tessera-coordinator, two tessera-server shards and two tessera-worker daemons on 127.0.0.1
with TLS and a bearer token on every listener and channel, then, from Python's grpcio with stubs
generated at test time by grpc_python_plugin:
  - grpc.health.v1.Health/Check on each serving daemon (coordinator and shards) is SERVING;
  - server reflection (grpc.reflection.v1alpha) lists each daemon's services, and the
    descriptor it serves for tessera.v1.JobService has the methods of our proto;
  - the coordinator refuses a call without the token (UNAUTHENTICATED);
  - a small job (examples/fashion_mlp.textproto, 1 epoch capped at --max_steps) is submitted with
    JobService.CreateJob and watched with WatchJob to SUCCEEDED: events arrive in order (seq 1, 2,
    3..., steps never going back), the stream ends OK after the terminal event, and the final
    test accuracy is above --min_accuracy;
  - SIGTERM stops every daemon with exit status 0.
Exits 0 on success, 1 on a failed check, 77 (skip) when Fashion-MNIST is not installed.
"""

import argparse
import os
import sys
import time

import tessera_testlib as tl

DATASET_DIR = "/usr/share/datasets/fashion-mnist"
DATASET_FILES = ["train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
                 "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    tl.add_tool_args(p)
    p.add_argument("--coordinator_bin", required=True)
    p.add_argument("--server_bin", required=True)
    p.add_argument("--worker_bin", required=True)
    p.add_argument("--max_steps", type=int, default=200)
    p.add_argument("--min_accuracy", type=float, default=0.7)
    p.add_argument("--job_timeout", type=float, default=240.0)
    return p.parse_args()


def wait_members(client, address, shards, workers, timeout=60.0):
    """ClusterService.ListMembers until `shards` shards and `workers` workers are READY."""
    from tessera.v1 import job_pb2, job_pb2_grpc
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            with client.channel(address) as channel:
                r = job_pb2_grpc.ClusterServiceStub(channel).ListMembers(
                    job_pb2.ListMembersRequest(), timeout=tl.RPC_TIMEOUT,
                    metadata=client.metadata())
            ready = [m for m in r.members if m.state == job_pb2.MEMBER_STATE_READY]
            n_shards = sum(1 for m in ready if m.role == job_pb2.MEMBER_ROLE_SERVER)
            n_workers = sum(1 for m in ready if m.role == job_pb2.MEMBER_ROLE_WORKER)
            last = "%d shards and %d workers READY" % (n_shards, n_workers)
            if n_shards == shards and n_workers == workers:
                return r.members
        except tl.grpc.RpcError as e:
            last = "%s: %s" % (e.code().name, e.details())
        time.sleep(0.2)
    raise RuntimeError("the cluster did not come up within %.0f s (last: %s)" % (timeout, last))


def check_reflection(c, client, name, address, expected):
    from google.protobuf import descriptor_pb2
    from tessera.v1 import job_pb2
    from tessera_vendor import grpc_reflection_v1alpha_pb2 as r
    services = tl.list_services(client, address)
    tl.log("%s reflection lists: %s" % (name, ", ".join(services)))
    c.expect(set(expected) <= set(services),
             "%s reflection lists %s" % (name, ", ".join(expected)))
    if "tessera.v1.JobService" not in expected:
        return
    response = tl.reflection(client, address, r.ServerReflectionRequest(
        file_containing_symbol="tessera.v1.JobService"))
    methods = None
    for blob in response.file_descriptor_response.file_descriptor_proto:
        fd = descriptor_pb2.FileDescriptorProto.FromString(blob)
        for s in fd.service:
            if fd.package + "." + s.name == "tessera.v1.JobService":
                methods = sorted(m.name for m in s.method)
    ours = sorted(job_pb2.DESCRIPTOR.services_by_name["JobService"].methods_by_name)
    c.expect(methods == ours, "%s reflection serves JobService with methods %s (got %s)" % (
        name, ours, methods))


def watch_job(c, client, address, job_id, timeout):
    """WatchJob from seq 0 until the stream ends; returns (first record, events)."""
    from tessera.v1 import job_pb2, job_pb2_grpc
    first = None
    events = []
    with client.channel(address) as channel:
        stream = job_pb2_grpc.JobServiceStub(channel).WatchJob(
            job_pb2.WatchJobRequest(job_id=job_id, after_seq=0), timeout=timeout,
            metadata=client.metadata())
        for msg in stream:
            if first is None:
                first = msg
                continue
            if not msg.HasField("event"):
                c.expect(False, "every WatchJob message after the first has an event")
            e = msg.event
            events.append((e, msg.job))
            tl.log("event %d: %s step %d/%d epoch %d loss %.4f%s: %s" % (
                e.seq, job_pb2.JobState.Name(e.state), e.step, e.total_steps, e.epoch, e.loss,
                " test_accuracy %.4f" % e.test_accuracy if e.evaluated else "", e.message))
        c.expect(stream.code() == tl.grpc.StatusCode.OK,
                 "WatchJob ends OK (got %s: %s)" % (stream.code().name, stream.details()))
    return first, events


def run(args, scratch):
    from google.protobuf import text_format
    from tessera.v1 import job_pb2, job_pb2_grpc, job_spec_pb2

    c = tl.Checker()
    pki = tl.make_pki(os.path.join(scratch.path, "pki"))
    token_file = os.path.join(scratch.path, "token")
    token = tl.write_token(token_file)
    sec = tl.security_flags(pki, token_file)
    client = tl.Client("tls", pki, token)  # TLS, the right token, no client certificate

    coord = scratch.daemon("coordinator", [
        args.coordinator_bin, "--listen", "127.0.0.1:0",
        "--port_file", os.path.join(scratch.path, "coordinator.port"),
        "--data_dir", os.path.join(scratch.path, "coordinator"), "--num_shards", "2",
        "--log_level", "info"] + sec, os.path.join(scratch.path, "coordinator.port"))
    coord.start()
    coord.wait_port()
    tl.wait_serving(coord, client)

    shards = []
    for i in range(2):
        port_file = os.path.join(scratch.path, "shard-%d.port" % i)
        shards.append(scratch.daemon("shard-%d" % i, [
            args.server_bin, "--listen", "127.0.0.1:0", "--port_file", port_file,
            "--shard_index", str(i), "--coordinator", coord.address,
            "--data_dir", os.path.join(scratch.path, "shard-%d" % i), "--log_level", "info"] + sec,
            port_file).start())
    for s in shards:
        s.wait_port()
        tl.wait_serving(s, client)
    workers = []
    for i in range(2):
        port_file = os.path.join(scratch.path, "worker-%d.port" % i)
        workers.append(scratch.daemon("worker-%d" % i, [
            args.worker_bin, "--coordinator", coord.address, "--threads", "1",
            "--listen", "127.0.0.1:0", "--port_file", port_file,
            "--log_level", "info"] + sec, port_file).start())
    for w in workers:
        w.wait_port()
    members = wait_members(client, coord.address, shards=2, workers=2)
    tl.log("members: " + "; ".join("%s %s %s %s" % (
        m.id, job_pb2.MemberRole.Name(m.role), job_pb2.MemberState.Name(m.state), m.address)
        for m in members))

    # Health on every daemon (a worker serves only health and reflection).
    for d in [coord] + shards + workers:
        status = tl.health_check(client, d.address)
        c.expect(status == "SERVING", "health Check on %s (%s) is SERVING (got %s)" % (
            d.name, d.address, status))

    # Reflection.
    common = ["grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"]
    check_reflection(c, client, "coordinator", coord.address,
                     ["tessera.v1.JobService", "tessera.v1.ClusterService"] + common)
    for s in shards:
        check_reflection(c, client, s.name, s.address, ["tessera.v1.ParameterService"] + common)
    for w in workers:
        check_reflection(c, client, w.name, w.address, common)

    # The token is really in force: the same call without it is refused.
    try:
        tl.health_check(tl.Client("tls", pki, None), coord.address)
        c.expect(False, "health Check without the token is UNAUTHENTICATED (it passed)")
    except tl.grpc.RpcError as e:
        c.expect(e.code() == tl.grpc.StatusCode.UNAUTHENTICATED,
                 "health Check without the token is UNAUTHENTICATED (got %s: %s)" % (
                     e.code().name, e.details()))

    # A job, from the example spec.
    spec = job_spec_pb2.JobSpec()
    with open(os.path.join(args.source_dir, "examples", "fashion_mlp.textproto")) as f:
        text_format.Parse(f.read(), spec)
    spec.name = "py-client"
    spec.epochs = 1
    spec.max_steps = args.max_steps
    spec.num_workers = 2
    with client.channel(coord.address) as channel:
        job = job_pb2_grpc.JobServiceStub(channel).CreateJob(
            job_pb2.CreateJobRequest(spec=spec), timeout=tl.RPC_TIMEOUT,
            metadata=client.metadata())
    tl.log("created %s: %s %s" % (job.id, job_pb2.JobState.Name(job.state), job.reason))
    c.expect(job.id != "" and job.spec.max_steps == args.max_steps,
             "CreateJob returns the record (id %r, spec.max_steps %d)" % (job.id,
                                                                          job.spec.max_steps))
    c.expect(job.state in (job_pb2.JOB_STATE_PENDING, job_pb2.JOB_STATE_RUNNING),
             "a new job is PENDING or RUNNING (got %s)" % job_pb2.JobState.Name(job.state))

    started = time.monotonic()
    first, events = watch_job(c, client, coord.address, job.id, args.job_timeout)
    tl.log("watched %d events in %.1f s" % (len(events), time.monotonic() - started))
    c.expect(first is not None and not first.HasField("event") and first.job.id == job.id,
             "the first WatchJob message holds the record and no event")
    c.expect(len(events) >= 3, "at least 3 events (got %d)" % len(events))
    if not events:
        return c
    seqs = [e.seq for e, _ in events]
    c.expect(seqs == list(range(1, len(events) + 1)),
             "event seqs are 1..%d in order (got %s)" % (len(events), seqs))
    steps = [e.step for e, _ in events]
    c.expect(all(a <= b for a, b in zip(steps, steps[1:])),
             "event steps never go back (got %s)" % steps)
    progress = [e.step for e, _ in events[:-1]
                if e.state == job_pb2.JOB_STATE_RUNNING and e.step > 0]
    c.expect(len(progress) >= 1,
             "RUNNING events report progress before the end (steps %s)" % progress)
    times = [e.time_ms for e, _ in events]
    c.expect(all(a <= b for a, b in zip(times, times[1:])), "event times never go back")
    terminal = [e for e, _ in events if e.state in (
        job_pb2.JOB_STATE_SUCCEEDED, job_pb2.JOB_STATE_FAILED, job_pb2.JOB_STATE_CANCELLED)]
    c.expect(len(terminal) == 1 and terminal[0].seq == seqs[-1],
             "exactly one terminal event, and it is the last")
    last_event, final = events[-1]
    c.expect(final.state == job_pb2.JOB_STATE_SUCCEEDED,
             "the job ends SUCCEEDED (got %s: %s)" % (job_pb2.JobState.Name(final.state),
                                                     final.reason))
    c.expect(0 < final.total_steps <= args.max_steps and final.step == final.total_steps,
             "every step was done (step %d, total_steps %d, max_steps %d)" % (
                 final.step, final.total_steps, args.max_steps))
    c.expect(final.evaluated and final.test_accuracy > args.min_accuracy,
             "final test accuracy %.4f > %.2f" % (final.test_accuracy, args.min_accuracy))
    c.expect(last_event.evaluated and abs(last_event.test_accuracy - final.test_accuracy) < 1e-9,
             "the terminal event carries the final evaluation")
    with client.channel(coord.address) as channel:
        got = job_pb2_grpc.JobServiceStub(channel).GetJob(
            job_pb2.GetJobRequest(job_id=job.id), timeout=tl.RPC_TIMEOUT,
            metadata=client.metadata())
    c.expect(got.state == job_pb2.JOB_STATE_SUCCEEDED and got.test_accuracy == final.test_accuracy,
             "GetJob agrees with the watch (%s, %.4f)" % (job_pb2.JobState.Name(got.state),
                                                          got.test_accuracy))

    # SIGTERM: every daemon drains and exits 0 (workers first, the coordinator last).
    for d in workers + shards + [coord]:
        rc = d.stop()
        c.expect(rc == 0, "%s exits 0 on SIGTERM (got %s)" % (d.name, rc))
    return c


def main():
    args = parse_args()
    tl.exit_on_signals()
    missing = [f for f in DATASET_FILES if not os.access(os.path.join(DATASET_DIR, f), os.R_OK)]
    if missing:
        print("SKIPPED: Fashion-MNIST is not installed in %s (missing %s; Debian package "
              "dataset-fashion-mnist, scripts/install-deps.sh installs it)" % (
                  DATASET_DIR, ", ".join(missing)), flush=True)
        return tl.SKIP
    return tl.run_test(args, "tessera-py-health-", run)


if __name__ == "__main__":
    sys.exit(main())
