"""A test page and the server that records what the page reports, run INSIDE a sandbox.

The desktop tests copy this file into the sandbox with write_file and start it
with exec: ``python3 page_server.py DIR``. It serves one page on the sandbox's
own loopback (a free port, written to ``DIR/port``) and writes what the page's
own script reports into DIR: ``typed`` (the input's value after each input
event), ``keys`` (one line per key combo with ctrl or alt, as the page saw it)
and ``scroll`` (the page's scrollY once scrolling stops). So the tests read an
app's effect back with read_file, not what they sent. Standard library only:
it runs on whatever python3 the sandbox has.
"""

from __future__ import annotations

import http.server
import os
import sys
import threading

PAGE = b"""<!doctype html><meta charset="utf-8"><title>shinken desktop test page</title>
<style>
body { margin: 0; height: 6000px; font: 20px sans-serif; background: #fff; }
/* The magenta border is how a test finds the input on a screenshot. */
#q { position: absolute; left: 100px; top: 120px; width: 640px; height: 48px; font-size: 28px;
     border: 8px solid #ff00ff; outline: none; padding: 0 8px; background: #fff; }
</style>
<input id="q" autocomplete="off" spellcheck="false">
<script>
// Numbered per page: the requests run concurrently and may arrive out of order; the
// server keeps the latest one's value.
const page = Math.floor(Math.random() * 1e9);
let seq = 0;
const send = (path, value) => fetch(path, {method: "POST", body: page + " " + ++seq + "\\n" + value});
const q = document.getElementById("q");
q.addEventListener("input", () => send("/typed", q.value));
document.addEventListener("keydown", (e) => {
  if (e.ctrlKey || e.altKey) send("/keys", (e.ctrlKey ? "ctrl+" : "") + (e.altKey ? "alt+" : "") + e.key);
});
let settle;
addEventListener("scroll", () => { clearTimeout(settle); settle = setTimeout(() => send("/scroll", String(scrollY)), 150); });
</script>
"""
REPORTS = ("typed", "keys", "scroll")


def main() -> None:
    out = sys.argv[1]
    lock = threading.Lock()
    latest: dict[tuple[str, bytes], int] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(PAGE)))
            self.end_headers()
            self.wfile.write(PAGE)

        def do_POST(self) -> None:
            head, _, body = self.rfile.read(int(self.headers.get("Content-Length", "0"))).partition(b"\n")
            page, _, number = head.partition(b" ")
            name = self.path.strip("/")
            if name in REPORTS:
                path = os.path.join(out, name)
                with lock:
                    if name == "keys":
                        with open(path, "ab") as f:
                            f.write(body + b"\n")
                    elif int(number) > latest.get((name, page), 0):  # replaced whole: never half a value
                        latest[name, page] = int(number)
                        with open(path + ".tmp", "wb") as f:
                            f.write(body)
                        os.replace(path + ".tmp", path)
            self.send_response(204)
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    with open(os.path.join(out, "port.tmp"), "w") as f:
        f.write(str(server.server_address[1]))
    os.replace(os.path.join(out, "port.tmp"), os.path.join(out, "port"))
    with open(os.path.join(out, "pid"), "w") as f:
        f.write(str(os.getpid()))
    server.serve_forever()


if __name__ == "__main__":
    main()
