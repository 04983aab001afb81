"""Shared pieces of the Python client tests (issue #5): a client that is not ours.

- generate_stubs(): Python modules for tessera/v1/*.proto and the standard health and reflection
  protos, made at test time with protoc and Debian's grpc_python_plugin into a scratch folder.
- make_pki(): a test PKI made with openssl (a CA, a server certificate for 127.0.0.1/localhost that
  also serves as a client certificate, a client certificate, and a second, wrong CA with its own
  client certificate).
- Daemon / Scratch: the real tessera-coordinator, tessera-server and tessera-worker binaries as
  child processes on 127.0.0.1 with ports picked at run time (--listen 127.0.0.1:0, --port_file),
  killed when the test ends (and by the kernel if the test itself dies: setpriv --pdeathsig).
- Credentials: the channel credentials of each client the tests play (plaintext, TLS without a
  client certificate, with the wrong CA's certificate, with a valid one) and the token metadata.

Every wait is bounded in time. Nothing here asserts; the tests do.
"""

import glob
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

import grpc

SKIP = 77  # ctest SKIP_RETURN_CODE

RPC_TIMEOUT = 5.0  # seconds; every call carries a deadline


def log(*args):
    print(*args, flush=True)


def read(path):
    try:
        with open(path, "r", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def tail(path, n=2000):
    text = read(path)
    return text[-n:]


# ---------------------------------------------------------------- stubs


def add_tool_args(parser):
    """--source_dir, --protoc and --grpc_python_plugin (CMake passes the ones it found)."""
    parser.add_argument("--source_dir", required=True)
    parser.add_argument("--protoc", default="protoc")
    parser.add_argument("--grpc_python_plugin", default="/usr/bin/grpc_python_plugin")


def generate_stubs(args, out_dir):
    """protoc + grpc_python_plugin over proto/tessera/v1/*.proto and the vendored health and
    reflection protos (tests/python/protos) into out_dir, which is put first on sys.path.
    Raises on a protoc error."""
    vendor = os.path.join(args.source_dir, "tests", "python", "protos")
    protos = sorted(glob.glob(os.path.join(args.source_dir, "proto", "tessera", "v1", "*.proto")))
    protos += sorted(glob.glob(os.path.join(vendor, "tessera_vendor", "*.proto")))
    cmd = [args.protoc, "-I", os.path.join(args.source_dir, "proto"), "-I", vendor,
           "--python_out=" + out_dir, "--grpc_out=" + out_dir,
           "--plugin=protoc-gen-grpc=" + args.grpc_python_plugin] + protos
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise RuntimeError("protoc failed (%d): %s\n%s" % (r.returncode, " ".join(cmd), r.stderr))
    sys.path.insert(0, out_dir)


# ---------------------------------------------------------------- PKI


def _openssl(args, cwd):
    r = subprocess.run(["openssl"] + args, cwd=cwd, capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise RuntimeError("openssl %s failed: %s" % (" ".join(args), r.stderr))


def _make_ca(cwd, name, cn):
    _openssl(["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
              "-nodes", "-keyout", name + ".key", "-out", name + ".pem", "-days", "2",
              "-subj", "/CN=" + cn,
              "-addext", "basicConstraints=critical,CA:TRUE",
              "-addext", "keyUsage=critical,keyCertSign,cRLSign"], cwd)


def _make_leaf(cwd, ca, name, cn, ext_lines):
    with open(os.path.join(cwd, name + ".ext"), "w") as f:
        f.write("\n".join(["basicConstraints=CA:FALSE",
                           "keyUsage=critical,digitalSignature,keyEncipherment"] + ext_lines)
                + "\n")
    _openssl(["req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
              "-keyout", name + ".key", "-out", name + ".csr", "-subj", "/CN=" + cn], cwd)
    _openssl(["x509", "-req", "-in", name + ".csr", "-CA", ca + ".pem", "-CAkey", ca + ".key",
              "-set_serial", str(secrets.randbits(63)), "-days", "2", "-out", name + ".pem",
              "-extfile", name + ".ext"], cwd)


def make_pki(directory):
    """Returns {name: path} for ca, server.{pem,key} (SAN IP:127.0.0.1, DNS:localhost;
    serverAuth + clientAuth, so daemons also dial with it), client.{pem,key} (clientAuth),
    wrong_ca and wrong_client.{pem,key} (a client certificate from the wrong CA)."""
    os.makedirs(directory, exist_ok=True)
    _make_ca(directory, "ca", "Tessera test CA")
    _make_ca(directory, "wrong_ca", "Some other CA")
    _make_leaf(directory, "ca", "server", "localhost",
               ["subjectAltName=IP:127.0.0.1,DNS:localhost",
                "extendedKeyUsage=serverAuth,clientAuth"])
    _make_leaf(directory, "ca", "client", "python-client", ["extendedKeyUsage=clientAuth"])
    _make_leaf(directory, "wrong_ca", "wrong_client", "python-client",
               ["extendedKeyUsage=clientAuth"])
    paths = {}
    for n in ["ca", "wrong_ca", "server", "client", "wrong_client"]:
        paths[n] = os.path.join(directory, n + ".pem")
        paths[n + "_key"] = os.path.join(directory, n + ".key")
    os.chmod(paths["server_key"], 0o600)
    return paths


def write_token(path, token=None):
    token = token or secrets.token_hex(24)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


# ---------------------------------------------------------------- credentials


def _bytes(path):
    with open(path, "rb") as f:
        return f.read()


class Client:
    """One way of dialing: `kind` is plaintext | tls | tls+wrong-ca-cert | tls+cert and `token`
    None | the token to send (sent as `authorization: Bearer <token>` metadata)."""

    def __init__(self, kind, pki, token=None):
        self.kind = kind
        self.pki = pki
        self.token = token

    def channel(self, address):
        # A private subchannel pool per channel: no connection (and no TLS session) is shared
        # between the clients of the matrix.
        options = [("grpc.use_local_subchannel_pool", 1)]
        if self.kind == "plaintext":
            return grpc.insecure_channel(address, options=options)
        root = _bytes(self.pki["ca"])
        if self.kind == "tls":
            creds = grpc.ssl_channel_credentials(root_certificates=root)
        elif self.kind == "tls+wrong-ca-cert":
            creds = grpc.ssl_channel_credentials(
                root_certificates=root, private_key=_bytes(self.pki["wrong_client_key"]),
                certificate_chain=_bytes(self.pki["wrong_client"]))
        elif self.kind == "tls+cert":
            creds = grpc.ssl_channel_credentials(
                root_certificates=root, private_key=_bytes(self.pki["client_key"]),
                certificate_chain=_bytes(self.pki["client"]))
        else:
            raise ValueError(self.kind)
        return grpc.secure_channel(address, creds, options=options)

    def metadata(self):
        # Added by hand on every call, so that a plaintext channel can carry a token too (gRPC's
        # call credentials refuse to travel over plaintext).
        if self.token is None:
            return None
        return (("authorization", "Bearer " + self.token),)


# ---------------------------------------------------------------- processes

def _die_with_parent(argv):
    """argv run through `setpriv --pdeathsig KILL` (util-linux), so that the daemon dies with the
    test even when the test is killed (a ctest timeout). The death signal survives the exec and
    the daemons' own re-exec. (Not preexec_fn: forking a process that has gRPC threads and running
    Python in the child can deadlock.)"""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return argv
    return [setpriv, "--pdeathsig", "KILL", "--"] + argv


def daemon_env():
    """The daemons' environment: this process's, minus TESSERA_* (the daemons read their flags
    from TESSERA_<FLAG>: a caller's TESSERA_LISTEN or TESSERA_AUTH_TOKEN_FILE must not change the
    test), NOTIFY_SOCKET, WATCHDOG_* and JOURNAL_STREAM (systemd's, when the test runs under it),
    with OMP_WAIT_POLICY=passive."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TESSERA_") and k != "NOTIFY_SOCKET"
           and not k.startswith("WATCHDOG_") and k != "JOURNAL_STREAM"}
    env["OMP_WAIT_POLICY"] = "passive"
    return env


class Daemon:
    """A daemon started by the test; stdout and stderr go to <dir>/<name>.log."""

    def __init__(self, name, argv, directory, port_file=None):
        self.name = name
        self.argv = argv
        self.log_path = os.path.join(directory, name + ".log")
        self.port_file = port_file
        self.proc = None
        self.port = None

    def start(self):
        if self.port_file and os.path.exists(self.port_file):
            os.unlink(self.port_file)
        env = daemon_env()
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(_die_with_parent(self.argv), stdout=logf,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=env)
        log("started %s (pid %d): %s" % (self.name, self.proc.pid, " ".join(self.argv)))
        return self

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def wait_port(self, timeout=30.0):
        """The port from --port_file; raises with the log's end if the daemon exits first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError("%s exited with %s before writing %s; the end of %s:\n%s" % (
                    self.name, self.proc.returncode, self.port_file, self.log_path,
                    tail(self.log_path)))
            text = read(self.port_file).strip()
            if text.isdigit() and 0 < int(text) < 65536:
                self.port = int(text)
                return self.port
            time.sleep(0.05)
        raise RuntimeError("%s wrote no port to %s within %.0f s; the end of %s:\n%s" % (
            self.name, self.port_file, timeout, self.log_path, tail(self.log_path)))

    @property
    def address(self):
        return "127.0.0.1:%d" % self.port

    def stop(self, timeout=15.0):
        """SIGTERM (the daemons drain and exit 0), SIGKILL after `timeout`. Returns the exit
        status (negative: killed by that signal)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log("%s did not exit %.0f s after SIGTERM: SIGKILL" % (self.name, timeout))
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def exit_on_signals():
    """SIGTERM, SIGINT and SIGHUP raise SystemExit(128 + signal), so that the test's `finally`
    stops the daemons and removes the scratch folder."""
    def handler(signum, _frame):
        raise SystemExit(128 + signum)
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, handler)


class Scratch:
    """A scratch folder (kept when TESSERA_KEEP_SCRATCH is set) and the daemons to stop."""

    def __init__(self, prefix):
        self.path = tempfile.mkdtemp(prefix=prefix)
        self.daemons = []

    def daemon(self, name, argv, port_file=None):
        d = Daemon(name, argv, self.path, port_file)
        self.daemons.append(d)
        return d

    def close(self, dump_logs=False):
        for d in reversed(self.daemons):
            try:
                d.stop()
            except Exception as e:  # keep stopping the others
                log("stopping %s: %s" % (d.name, e))
        if dump_logs:
            for d in self.daemons:
                log("--- the end of %s:\n%s" % (d.log_path, tail(d.log_path, 3000)))
        if os.environ.get("TESSERA_KEEP_SCRATCH"):
            log("scratch kept in " + self.path)
        else:
            shutil.rmtree(self.path, ignore_errors=True)


def run_test(args, scratch_prefix, run):
    """A test's main body: generates the stubs into a fresh Scratch, calls run(args, scratch),
    which returns a Checker, and logs the failed checks and PASSED or FAILED. Returns the exit
    status (0 or 1); the daemons' logs are printed when it fails."""
    scratch = Scratch(scratch_prefix)
    ok = False
    try:
        generate_stubs(args, tempfile.mkdtemp(dir=scratch.path, prefix="stubs-"))
        c = run(args, scratch)
        ok = not c.failures
        if c.failures:
            log("%d checks failed:\n  %s" % (len(c.failures), "\n  ".join(c.failures)))
    except Exception:
        traceback.print_exc()
    finally:
        scratch.close(dump_logs=not ok)
    log("PASSED" if ok else "FAILED")
    return 0 if ok else 1


def security_flags(pki, token_file, client_ca=False):
    """The daemons' security flags (ops-contract.md): serve TLS with the server certificate, dial
    TLS trusting the CA and presenting the same certificate as a client certificate (it carries
    clientAuth too), the token file, and with `client_ca` --tls_client_ca (mutual TLS; not for
    tessera-worker, which serves no gRPC)."""
    flags = ["--tls_cert", pki["server"], "--tls_key", pki["server_key"], "--tls_ca", pki["ca"],
             "--auth_token_file", token_file]
    if client_ca:
        flags += ["--tls_client_ca", pki["ca"]]
    return flags


class Checker:
    """Collects failed expectations; the test exits 1 when there is any."""

    def __init__(self):
        self.failures = []

    def expect(self, ok, what):
        if ok:
            log("ok: " + what)
        else:
            log("FAILED: " + what)
            self.failures.append(what)
        return ok


# ---------------------------------------------------------------- RPCs (after generate_stubs)


def health_check(client, address, service=""):
    """grpc.health.v1.Health/Check; returns the ServingStatus name, raises grpc.RpcError."""
    from tessera_vendor import grpc_health_v1_pb2 as h
    from tessera_vendor import grpc_health_v1_pb2_grpc as hg
    with client.channel(address) as channel:
        r = hg.HealthStub(channel).Check(h.HealthCheckRequest(service=service),
                                         timeout=RPC_TIMEOUT, metadata=client.metadata())
        return h.HealthCheckResponse.ServingStatus.Name(r.status)


def reflection(client, address, request):
    """One ServerReflectionInfo exchange; returns the response, raises grpc.RpcError."""
    from tessera_vendor import grpc_reflection_v1alpha_pb2_grpc as rg
    with client.channel(address) as channel:
        stream = rg.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([request]), timeout=RPC_TIMEOUT, metadata=client.metadata())
        responses = list(stream)
    if len(responses) != 1:
        raise RuntimeError("%d reflection responses to one request" % len(responses))
    return responses[0]


def list_services(client, address):
    from tessera_vendor import grpc_reflection_v1alpha_pb2 as r
    response = reflection(client, address, r.ServerReflectionRequest(list_services=""))
    return sorted(s.name for s in response.list_services_response.service)


def wait_serving(daemon, client, timeout=30.0):
    """Polls health Check until SERVING; raises with the last error and the log's end."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if not daemon.alive():
            raise RuntimeError("%s exited with %s; the end of %s:\n%s" % (
                daemon.name, daemon.proc.returncode, daemon.log_path, tail(daemon.log_path)))
        try:
            last = health_check(client, daemon.address)
            if last == "SERVING":
                return
        except grpc.RpcError as e:
            last = "%s: %s" % (e.code().name, e.details())
        time.sleep(0.1)
    raise RuntimeError("%s at %s is not SERVING after %.0f s (last: %s); the end of %s:\n%s" % (
        daemon.name, daemon.address, timeout, last, daemon.log_path, tail(daemon.log_path)))
