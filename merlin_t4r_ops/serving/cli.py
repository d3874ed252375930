"""Command-line entry points: ``merlin-t4r-serve`` and a ``tritonserver`` shim.

``tritonserver`` on PATH lets Merlin's own ``merlin.systems.triton.utils.run_triton_server``
find the server that the ``nvidia-pytriton`` wheel ships, with the environment it needs.
"""

import argparse
import os
import sys

from merlin_t4r_ops.serving.server import LOOPBACK, free_port, server_command
from merlin_t4r_ops.serving.triton_env import (
    backend_directory,
    server_environment,
    tritonserver_executable,
)

__all__ = ["serve_main", "tritonserver_main"]


def serve_main(argv=None) -> None:
    """``merlin-t4r-serve MODEL_REPOSITORY [--grpc-port N] [--http-port N] [--host H]``."""
    parser = argparse.ArgumentParser(
        prog="merlin-t4r-serve",
        description="Serve an exported Merlin ensemble with tritonserver, in the foreground.",
    )
    parser.add_argument("model_repository")
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--host", default=LOOPBACK,
                        help="address to bind (default %(default)s; 0.0.0.0 exposes it)")
    args, extra = parser.parse_known_args(argv)
    if not os.path.isdir(args.model_repository):
        parser.error(f"MODEL_REPOSITORY {args.model_repository!r} is not a directory")
    command = server_command(
        args.model_repository, host=args.host,
        grpc_port=args.grpc_port or free_port(args.host),
        http_port=args.http_port or free_port(args.host),
        extra_args=extra,
    )
    print(f"merlin-t4r-serve: gRPC on {args.host}:{args.grpc_port}, "
          f"HTTP on {args.host}:{args.http_port}", flush=True)
    # exec: signals reach the server directly and no wrapper process is left behind.
    os.execve(command[0], command, server_environment())


def tritonserver_main(argv=None) -> None:
    """Run the wheel's ``tritonserver`` with its Python stub set up for this interpreter."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not any(a.startswith("--backend-directory") for a in args):
        args.append(f"--backend-directory={backend_directory()}")
    binary = str(tritonserver_executable())
    os.execve(binary, [binary, *args], server_environment())
