#!/usr/bin/python3
"""The TLS / mutual TLS x token matrix against every service (issue #5).

Makes a PKI with openssl (a CA; a server certificate with SAN IP:127.0.0.1, DNS:localhost and
serverAuth + clientAuth; a client certificate; a wrong CA with its own client certificate) and a
token file, then starts tessera-coordinator and one tessera-server (registered with the
coordinator) with --tls_cert --tls_key --tls_client_ca --auth_token_file: mutual TLS.

From Python's grpcio, one cheap method of every service on each daemon
  coordinator: JobService.GetJob (unknown job), ClusterService.ListMembers, Health.Check,
               ServerReflection (list services)
  shard:       ParameterService.DropJob (unknown job), Health.Check, ServerReflection
is called as each client: plaintext, TLS without a client certificate, TLS with the wrong CA's
client certificate, TLS with a valid client certificate; each with no token, a bad token and the
right token (sent as `authorization: Bearer` metadata, by hand on plaintext too). Expected:
  - only a valid certificate with the right token gets through: the method's own answer (OK, or
    NOT_FOUND for the unknown job);
  - a failed handshake (plaintext, no client certificate, the wrong CA) is UNAVAILABLE;
  - a valid certificate with no or a bad token is UNAUTHENTICATED.
The matrix is printed as a table. The daemons are still up and SERVING afterwards, and the shard
reached the coordinator over mutual TLS (it is READY in ListMembers).

Then both restart without --tls_client_ca (TLS on the server side only) and the matrix runs again:
plaintext is UNAVAILABLE, every TLS client without the right token UNAUTHENTICATED, and every TLS
client with it (TLS without a client certificate included) gets through.
Exits 0 on success, 1 on a failed check.
"""

import argparse
import os
import sys
import time

import tessera_testlib as tl
from tessera_testlib import grpc

KINDS = ["plaintext", "tls", "tls+wrong-ca-cert", "tls+cert"]
TOKENS = ["none", "bad", "right"]
SHORT = {
    "OK": "OK",
    "NOT_FOUND": "NOT_FOUND",
    "UNAVAILABLE": "UNAVAIL",
    "UNAUTHENTICATED": "UNAUTH",
}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    tl.add_tool_args(p)
    p.add_argument("--coordinator_bin", required=True)
    p.add_argument("--server_bin", required=True)
    return p.parse_args()


# --- one cheap call per service: returns the status code name ("OK" on success) --------------


def _code(fn):
    try:
        fn()
        return "OK"
    except grpc.RpcError as e:
        return e.code().name


def call_get_job(client, address):
    from tessera.v1 import job_pb2, job_pb2_grpc

    def go():
        with client.channel(address) as ch:
            job_pb2_grpc.JobServiceStub(ch).GetJob(
                job_pb2.GetJobRequest(job_id="no-such-job-1"), timeout=tl.RPC_TIMEOUT,
                metadata=client.metadata())
    return _code(go)


def call_list_members(client, address):
    from tessera.v1 import job_pb2, job_pb2_grpc

    def go():
        with client.channel(address) as ch:
            job_pb2_grpc.ClusterServiceStub(ch).ListMembers(
                job_pb2.ListMembersRequest(), timeout=tl.RPC_TIMEOUT, metadata=client.metadata())
    return _code(go)


def call_drop_job(client, address):
    from tessera.v1 import parameter_pb2, parameter_pb2_grpc

    def go():
        with client.channel(address) as ch:
            parameter_pb2_grpc.ParameterServiceStub(ch).DropJob(
                parameter_pb2.DropJobRequest(job_id="no-such-job-1"), timeout=tl.RPC_TIMEOUT,
                metadata=client.metadata())
    return _code(go)


def call_health(client, address):
    def go():
        status = tl.health_check(client, address)
        if status != "SERVING":
            raise RuntimeError("health Check answered %s" % status)
    return _code(go)


def call_reflection(client, address, expected):
    def go():
        services = tl.list_services(client, address)
        if expected not in services:
            raise RuntimeError("reflection does not list %s: %s" % (expected, services))
    return _code(go)


def targets(coord, shard):
    """(column title, daemon, call, the code when the call gets through)."""
    return [
        ("coord JobService", coord, call_get_job, "NOT_FOUND"),
        ("coord ClusterService", coord, call_list_members, "OK"),
        ("coord Health", coord, call_health, "OK"),
        ("coord Reflection", coord,
         lambda cl, a: call_reflection(cl, a, "tessera.v1.JobService"), "OK"),
        ("shard ParameterService", shard, call_drop_job, "NOT_FOUND"),
        ("shard Health", shard, call_health, "OK"),
        ("shard Reflection", shard,
         lambda cl, a: call_reflection(cl, a, "tessera.v1.ParameterService"), "OK"),
    ]


def expected_code(mutual, kind, token, through):
    if kind == "plaintext":
        return "UNAVAILABLE"  # a plaintext client against a TLS port: no handshake
    if mutual and kind != "tls+cert":
        return "UNAVAILABLE"  # no client certificate, or one from the wrong CA
    if token != "right":
        return "UNAUTHENTICATED"
    return through


def run_matrix(c, title, mutual, pki, token, coord, shard):
    cols = targets(coord, shard)
    header = ["client / token"] + [t[0] for t in cols]
    rows = []
    mismatches = 0
    for kind in KINDS:
        for tok in TOKENS:
            sent = {"none": None, "bad": "not-" + token, "right": token}[tok]
            client = tl.Client(kind, pki, sent)
            row = ["%s / %s" % (kind, tok)]
            for name, daemon, call, through in cols:
                got = call(client, daemon.address)
                want = expected_code(mutual, kind, tok, through)
                cell = SHORT.get(got, got)
                if got != want:
                    mismatches += 1
                    cell += " (want %s)" % SHORT.get(want, want)
                    c.expect(False, "%s: %s with %s / token %s is %s (want %s)" % (
                        title, name, kind, tok, got, want))
                row.append(cell)
            rows.append(row)
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]

    def line(r):
        return "| " + " | ".join(v.ljust(w) for v, w in zip(r, widths)) + " |"
    table = [line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    table += [line(r) for r in rows]
    tl.log("\n%s\n%s\n" % (title, "\n".join(table)))
    c.expect(mismatches == 0, "%s: all %d cells as expected (%d differ)" % (
        title, len(rows) * len(cols), mismatches))


def start_pair(scratch, args, pki, token_file, mutual, tag):
    sec = tl.security_flags(pki, token_file, client_ca=mutual)
    valid = tl.Client("tls+cert", pki, tl.read(token_file).strip())
    cport = os.path.join(scratch.path, "coordinator-%s.port" % tag)
    coord = scratch.daemon("coordinator-" + tag, [
        args.coordinator_bin, "--listen", "127.0.0.1:0", "--port_file", cport,
        "--data_dir", os.path.join(scratch.path, "coordinator-" + tag), "--num_shards", "1",
        "--log_level", "info"] + sec, cport).start()
    coord.wait_port()
    tl.wait_serving(coord, valid)
    sport = os.path.join(scratch.path, "shard-%s.port" % tag)
    shard = scratch.daemon("shard-" + tag, [
        args.server_bin, "--listen", "127.0.0.1:0", "--port_file", sport, "--shard_index", "0",
        "--coordinator", coord.address, "--data_dir", os.path.join(scratch.path, "shard-" + tag),
        "--log_level", "info"] + sec, sport).start()
    shard.wait_port()
    tl.wait_serving(shard, valid)
    return coord, shard, valid


def shard_registered(client, coord, timeout=30.0):
    """Whether the coordinator lists one READY shard (it registered over the secured channel)."""
    from tessera.v1 import job_pb2, job_pb2_grpc
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with client.channel(coord.address) as ch:
            r = job_pb2_grpc.ClusterServiceStub(ch).ListMembers(
                job_pb2.ListMembersRequest(), timeout=tl.RPC_TIMEOUT, metadata=client.metadata())
        if any(m.role == job_pb2.MEMBER_ROLE_SERVER and m.state == job_pb2.MEMBER_STATE_READY
               for m in r.members):
            return True
        time.sleep(0.2)
    return False


def check_still_up(c, title, valid, daemons):
    for d in daemons:
        status = tl.health_check(valid, d.address) if d.alive() else "exited %s" % (
            d.proc.returncode)
        c.expect(status == "SERVING", "%s: %s still SERVING after the matrix (got %s)" % (
            title, d.name, status))


def run(args, scratch):
    c = tl.Checker()
    pki = tl.make_pki(os.path.join(scratch.path, "pki"))
    token_file = os.path.join(scratch.path, "token")
    token = tl.write_token(token_file)

    # Mutual TLS + token.
    title = "mutual TLS (--tls_client_ca) + token"
    coord, shard, valid = start_pair(scratch, args, pki, token_file, True, "mtls")
    c.expect(shard_registered(valid, coord),
             "%s: the shard registered with the coordinator over mutual TLS" % title)
    run_matrix(c, title, True, pki, token, coord, shard)
    check_still_up(c, title, valid, [coord, shard])
    for d in (shard, coord):
        rc = d.stop()
        c.expect(rc == 0, "%s exits 0 on SIGTERM (got %s)" % (d.name, rc))

    # Server-side TLS only + token.
    title = "server TLS (no --tls_client_ca) + token"
    coord, shard, valid = start_pair(scratch, args, pki, token_file, False, "tls")
    c.expect(shard_registered(valid, coord),
             "%s: the shard registered with the coordinator over TLS" % title)
    no_cert = tl.Client("tls", pki, token)
    c.expect(call_get_job(no_cert, coord.address) == "NOT_FOUND" and
             call_health(no_cert, shard.address) == "OK",
             "%s: TLS without a client certificate and the right token gets through" % title)
    run_matrix(c, title, False, pki, token, coord, shard)
    check_still_up(c, title, valid, [coord, shard])
    return c


def main():
    args = parse_args()
    tl.exit_on_signals()
    return tl.run_test(args, "tessera-py-matrix-", run)


if __name__ == "__main__":
    sys.exit(main())
