"""Command-line entry points: ``merlin-t4r-serve`` and a ``tritonserver`` shim.

``tritonserver`` on PATH lets Merlin's own ``merlin.systems.triton.utils.run_triton_server``
find the server that the ``nvidia-pytriton`` wheel ships, with the environment it needs.
Both bind 127.0.0.1 unless told otherwise, and warn loudly when told otherwise
(:mod:`merlin_t4r_ops.serving.binding` says why).
"""

import argparse
import os
import sys
from typing import List, Mapping, Optional, Sequence

from merlin_t4r_ops.serving.binding import (
    ADDRESS_FLAGS,
    LOOPBACK,
    has_flag,
    warn_for_addresses,
)
from merlin_t4r_ops.serving.server import server_command, server_ports
from merlin_t4r_ops.serving.triton_env import (
    backend_directory,
    server_environment,
    tritonserver_executable,
)

__all__ = ["serve_main", "tritonserver_main", "shim_command", "HOST_VARIABLE"]

# Merlin's run_triton_server writes the command line itself: the environment is the only
# way to open the shim up from there.
HOST_VARIABLE = "MERLIN_T4R_TRITON_HOST"


def serve_main(argv=None) -> None:
    """``merlin-t4r-serve MODEL_REPOSITORY [--grpc-port N] [--http-port N] [--host H]``."""
    parser = argparse.ArgumentParser(
        prog="merlin-t4r-serve",
        description="Serve an exported Merlin ensemble with tritonserver, in the foreground.",
    )
    parser.add_argument("model_repository")
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--metrics-port", type=int, default=8002,
                        help="Triton's Prometheus metrics, on 127.0.0.1 (default %(default)s)")
    parser.add_argument("--host", default=LOOPBACK,
                        help="address to bind (default %(default)s; anything else warns, "
                             "see the README's security section)")
    args, extra = parser.parse_known_args(argv)
    if not os.path.isdir(args.model_repository):
        parser.error(f"MODEL_REPOSITORY {args.model_repository!r} is not a directory")
    grpc_port, http_port, metrics_port = server_ports(
        args.host, args.grpc_port, args.http_port, args.metrics_port)
    command = server_command(args.model_repository, host=args.host, grpc_port=grpc_port,
                             http_port=http_port, metrics_port=metrics_port, extra_args=extra)
    print(f"merlin-t4r-serve: gRPC on {args.host}:{grpc_port}, "
          f"HTTP on {args.host}:{http_port}, metrics on {LOOPBACK}:{metrics_port}", flush=True)
    # exec: signals reach the server directly and no wrapper process is left behind.
    os.execve(command[0], command, server_environment())


def _pop_host(args: Sequence[str]):
    """This shim's own ``--host ADDRESS`` (``None`` without it), and the rest of ``args``."""
    # No abbreviations: tritonserver's --host-policy must pass through untouched.
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--host")
    known, rest = parser.parse_known_args(args)
    return known.host, rest


def shim_command(argv: Sequence[str], environ: Mapping[str, str] = os.environ) -> List[str]:
    """The command line the ``tritonserver`` shim execs for ``argv``.

    Each endpoint (HTTP, gRPC, metrics) binds what its ``--*-address`` flag asks for;
    without one, the shim's own ``--host ADDRESS``, else ``$MERLIN_T4R_TRITON_HOST``, else
    127.0.0.1. Every address that is not loopback warns.
    """
    host, args = _pop_host(argv)
    host = host or environ.get(HOST_VARIABLE) or LOOPBACK
    for flag in ADDRESS_FLAGS:
        if not has_flag(args, flag):
            args.append(f"{flag}={host}")
    warn_for_addresses(args)
    if not has_flag(args, "--backend-directory"):
        args.append(f"--backend-directory={backend_directory()}")
    return [str(tritonserver_executable()), *args]


def tritonserver_main(argv=None) -> None:
    """Run the wheel's ``tritonserver`` with its Python stub set up, bound to loopback."""
    command = shim_command(sys.argv[1:] if argv is None else argv)
    os.execve(command[0], command, server_environment())
