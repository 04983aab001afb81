#!/usr/bin/python3
"""Checks the gRPC health of Tessera daemons (grpc.health.v1.Health/Check), with TLS and a token.

Needs only python3-grpcio (Debian); the two health messages are encoded by hand, so no generated
stubs are needed. Example (from any host that may reach the daemons):

  tessera-health.py --ca /etc/tessera/tls/ca.crt --cert cli.crt --key cli.key \\
      --token_file /etc/tessera/token 10.0.0.1:7070 10.0.0.1:7000 10.0.0.2:7000

Prints one line per address ("10.0.0.1:7070 SERVING") and exits 0 when every daemon is SERVING,
1 otherwise (NOT_SERVING, or the call failed: the gRPC status code is printed), 64 on bad usage
(EX_USAGE: a missing or unreadable file, --cert without --key, --token_file without --ca, which
would send the token in plain text).
"""
import argparse
import sys

import grpc

STATUS_NAMES = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}
EX_USAGE = 64


class UsageParser(argparse.ArgumentParser):
    """argparse exits 2 on a usage error; this tool documents 64 (EX_USAGE)."""

    def error(self, message):
        self.print_usage(sys.stderr)
        self.exit(EX_USAGE, f"{self.prog}: error: {message}\n")


def decode_status(response: bytes) -> int:
    """HealthCheckResponse { ServingStatus status = 1; }: an empty message means UNKNOWN (0)."""
    if not response:
        return 0
    if len(response) >= 2 and response[0] == 0x08:
        return response[1]
    raise ValueError(f"unexpected HealthCheckResponse bytes {response!r}")


def encode_request(service: str) -> bytes:
    """HealthCheckRequest { string service = 1; }: the empty name asks about the whole server."""
    data = service.encode()
    if not data:
        return b""
    if len(data) > 127:
        raise ValueError("service name too long")
    return b"\x0a" + bytes([len(data)]) + data


def main() -> int:
    parser = UsageParser(description=__doc__.splitlines()[0])
    parser.add_argument("addresses", nargs="+", help="host:port of each daemon")
    parser.add_argument("--ca", help="CA bundle (PEM) that signed the daemons' certificates; "
                        "without it the call is plaintext")
    parser.add_argument("--cert", help="client certificate (PEM), for mutual TLS")
    parser.add_argument("--key", help="client private key (PEM), for mutual TLS")
    parser.add_argument("--token_file", help="bearer token file (first line); needs --ca, the "
                        "token is never sent in plain text")
    parser.add_argument("--server_name", help="name to check in the certificates instead of the "
                        "host dialed")
    parser.add_argument("--service", default="", help="service to ask about (default: the server)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds per call")
    args = parser.parse_args()
    if bool(args.cert) != bool(args.key):
        parser.error("--cert and --key go together")
    if args.token_file and not args.ca:
        parser.error("--token_file needs --ca: the token would be sent on a plaintext channel")
    if args.cert and not args.ca:
        parser.error("--cert and --key need --ca (they are for mutual TLS)")

    def read(path, flag):
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            parser.error(f"{flag} {path}: {e.strerror}")

    metadata = []
    if args.token_file:
        lines = read(args.token_file, "--token_file").decode("utf-8", "replace").splitlines()
        token = lines[0].strip() if lines else ""
        if not token:
            parser.error(f"--token_file {args.token_file} is empty")
        metadata.append(("authorization", f"Bearer {token}"))

    credentials = None
    if args.ca:
        credentials = grpc.ssl_channel_credentials(
            root_certificates=read(args.ca, "--ca"),
            private_key=read(args.key, "--key") if args.key else None,
            certificate_chain=read(args.cert, "--cert") if args.cert else None)
    options = []
    if args.server_name:
        options.append(("grpc.ssl_target_name_override", args.server_name))

    all_serving = True
    for address in args.addresses:
        if credentials is not None:
            channel = grpc.secure_channel(address, credentials, options=options)
        else:
            channel = grpc.insecure_channel(address, options=options)
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        try:
            response = check(encode_request(args.service), timeout=args.timeout,
                             metadata=metadata)
            status = decode_status(response)
            name = STATUS_NAMES.get(status, str(status))
            print(f"{address} {name}")
            all_serving = all_serving and status == 1
        except grpc.RpcError as e:
            print(f"{address} {e.code().name}: {e.details()}")
            all_serving = False
        finally:
            channel.close()
    return 0 if all_serving else 1


if __name__ == "__main__":
    sys.exit(main())
