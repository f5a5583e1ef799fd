"""CPU time of one engine call (``BackendClient.send``), in process, against a loopback engine.

    python bench/engine_client_cpu.py [--calls 2000] [--reps 3] [--trees OLD NEW]

A stub engine in a child process answers every POST at once with a small fixed JSON reply on
one kept-alive connection; the measured process sends a ~1.6 KB request (300 prompt ids) per
call and prints its own CPU (``time.process_time``) per call. With ``--trees``, each rep runs
once per tree (``PYTHONPATH`` pointed at it), alternated, and prints the same-run ratio
NEW / OLD: the client's own cost per turn, without the session server around it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time

REPLY = json.dumps({"choices": [{"message": {"role": "assistant", "content": "ok"}}]}).encode()


def _engine(sock: socket.socket) -> None:
    def serve(conn: socket.socket) -> None:
        with conn, conn.makefile("rb") as rfile:
            while rfile.readline():
                length = 0
                while (header := rfile.readline()).strip():
                    name, _, value = header.decode().partition(":")
                    if name.lower() == "content-length":
                        length = int(value)
                rfile.read(length)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                             % (len(REPLY), REPLY))

    while True:
        conn, _ = sock.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def measure(port: int, calls: int) -> float:
    """CPU milliseconds per call of this process's ``BackendClient.send``."""
    from webapp.backend import BackendClient

    client = BackendClient(f"http://127.0.0.1:{port}")
    body = json.dumps({"model": "m", "input_ids": list(range(300))}).encode()
    for _ in range(50):  # connect and warm up: not measured
        client.send("/generate", body)
    start = time.process_time()
    for _ in range(calls):
        client.send("/generate", body)
    cpu = time.process_time() - start
    client.close()
    return 1000 * cpu / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--trees", nargs=2, metavar=("OLD", "NEW"), help="compare two checkouts, alternated")
    ap.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)  # internal: be the engine
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)  # internal: measure against this port
    args = ap.parse_args()
    if args.engine:
        sock = socket.create_server(("127.0.0.1", 0))
        print(sock.getsockname()[1], flush=True)
        _engine(sock)
        return
    if args.port:
        print(f"{measure(args.port, args.calls):.4f}")
        return
    engine = subprocess.Popen([sys.executable, __file__, "--engine"], stdout=subprocess.PIPE, text=True)
    try:
        assert engine.stdout is not None
        port = int(engine.stdout.readline())
        trees = args.trees or [os.environ.get("PYTHONPATH", "")]
        runs: dict[str, list[float]] = {tree: [] for tree in trees}
        for rep in range(args.reps):
            for tree in trees:
                out = subprocess.run([sys.executable, __file__, "--port", str(port), "--calls", str(args.calls)],
                                     env=dict(os.environ, PYTHONPATH=tree), capture_output=True, text=True, check=True)
                runs[tree].append(float(out.stdout))
                print(f"rep {rep + 1} {tree}: {runs[tree][-1]:.4f} ms CPU per call", flush=True)
        for tree, values in runs.items():
            print(f"{tree}: median {statistics.median(values):.4f} ms, min {min(values):.4f} ms")
        if args.trees:
            old, new = (statistics.median(runs[tree]) for tree in trees)
            print(f"same-run ratio NEW / OLD (medians): {new / old:.2f}")
    finally:
        engine.kill()
        engine.wait()


if __name__ == "__main__":
    main()
