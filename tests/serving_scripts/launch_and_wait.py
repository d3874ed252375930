"""Start tritonserver on a repository from a thread that then ends, print the pids, wait.

The test that runs this kills it with SIGKILL and checks that nothing it started survives.
"""

import json
import sys
import threading
import time

import psutil

from merlin_t4r_ops.serving.server import start_server

started = {}
# The launching thread returns at once: the server must outlive the thread, not the process.
launcher = threading.Thread(target=lambda: started.update(server=start_server(sys.argv[1])))
launcher.start()
launcher.join()
server = started["server"]
server.wait_until_ready(timeout=240)
stubs = [p.pid for p in psutil.Process(server.process.pid).children(recursive=True)]
print(json.dumps({"server": server.process.pid, "stubs": stubs,
                  "ports": [int(server.grpc_url.rsplit(":", 1)[1]),
                            int(server.http_url.rsplit(":", 1)[1])]}), flush=True)
time.sleep(600)
