"""Journal format 2: disk per session, records GET speed, chat cost per turn index.

    PYTHONPATH=. python bench/journal_v2.py [--turns 10,50,200] [--r3-layers 6 --r3-topk 8] [--reps 3]

One ``shinken-session-server --workers 1`` with the embedded reference backend (R3 on, ``L x K``
int32 per token); for each ``T`` in ``--turns`` one session of ``T`` turns (an opening user message,
then a short one per turn, each reply appended), then:

1. disk: the session's journal bytes / the bytes of its final sequence packed (token ids as u32,
   the output logprobs as f64, ``(n - 1) x L x K`` int32 R3 rows) -> target <= 1.2 at 50 turns;
2. GET: ``GET /sessions/{id}`` of the longest session read on loopback (``recv_into`` a 4 MiB
   buffer), alternated ``--reps`` times with a raw ``os.sendfile`` of a file of the same byte
   count to the same reader (``records_journal.SendfileFloor``) -> target >= 0.5x;
3. per turn: chat latency over the turn index of the longest session (first, middle and last
   tenth; the engine's own cost and the server's TITO rendering grow with the sequence too);
4. replay bytes: engine-to-server R3 bytes per turn with incremental requests vs full ones, on an
   in-process session core whose engine is the reference backend's reply function (the same
   turns both ways, ``--replay-turns``).

Everything goes under one ``tempfile.mkdtemp`` directory, removed at the end; loopback only.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from rawhttp import Http
from records_journal import MiB, SendfileFloor, build_session, read_get, start_server


def final_sequence_bytes(get_body: bytes, row: int) -> tuple[int, int]:
    """(packed bytes of the final sequence, its token count) from a records GET."""
    doc = json.loads(get_body)
    ids = doc["metadata"]["accumulated_token_ids"]
    outputs = sum(len(r["response"]["choices"][0]["meta_info"]["output_token_logprobs"]) for r in doc["records"])
    return 4 * len(ids) + 8 * outputs + max(0, len(ids) - 1) * row, len(ids)


def replay_bytes(tmp: Path, args: argparse.Namespace) -> None:
    from webapp.backend import BackendReply
    from webapp.core import SessionCore, SessionRegistry
    from webapp.journal import JournalStore
    from webapp.reference_backend import R3Shape, reference_completion_json
    from webapp.tokenizers import ByteChatTokenizer

    tok = ByteChatTokenizer()
    shape = R3Shape(layers=args.r3_layers, top_k=args.r3_topk)

    class Engine:
        def __init__(self) -> None:
            self.r3_bytes: list[int] = []

        def send(self, path: str, payload: bytes, *, deadline: float | None = None) -> BackendReply:
            request = json.loads(payload)
            raw = reference_completion_json(request["input_ids"], tok, want_r3=True, r3=shape,
                                            r3_start=request.get("routed_experts_start_len", 0))
            reply = BackendReply.from_raw(raw)
            self.r3_bytes.append(sum(e - s for k, s, e in reply.replay_spans if k == "routed_experts"))
            return reply

        def close(self) -> None:
            pass

    per_turn = {}
    for incremental in (False, True):
        engine = Engine()
        core = SessionCore(tok, engine, registry=SessionRegistry(JournalStore(str(tmp / f"replay-{incremental}"))),
                           routing_replay_layers=args.r3_layers)
        core.dialect.incremental_replay = incremental
        sid = json.loads(core.create_session().read())["session_id"]
        msgs: list = [{"role": "user", "content": "x" * args.opening_bytes}]
        for i in range(args.replay_turns):
            reply = core.chat(sid, json.dumps({"messages": msgs}).encode())
            assert reply.status == 200, reply.read()[:300]
            msgs += [json.loads(reply.read())["choices"][0]["message"], {"role": "user", "content": f"turn {i}"}]
        per_turn[incremental] = engine.r3_bytes
        core.close()
    full, inc = per_turn[False], per_turn[True]
    print(f"R3 bytes from the engine over {len(full)} turns: full {sum(full):,} (last turn {full[-1]:,}), "
          f"incremental {sum(inc):,} (last turn {inc[-1]:,}): **x{sum(full) / sum(inc):.1f}** fewer")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", default="10,50,200")
    parser.add_argument("--r3-layers", type=int, default=6)
    parser.add_argument("--r3-topk", type=int, default=8)
    parser.add_argument("--opening-bytes", type=int, default=2000, help="the first user message")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--replay-turns", type=int, default=50)
    args = parser.parse_args()
    turns = [int(t) for t in args.turns.split(",")]
    row = 4 * args.r3_layers * args.r3_topk
    tmp = Path(tempfile.mkdtemp(prefix="bench-journal-v2-"))
    try:
        server = start_server(tmp, "v2", 1, ["--data-dir", str(tmp / "data"), "--reference-r3-layers",
                                             str(args.r3_layers), "--reference-r3-topk", str(args.r3_topk)],
                              Path.cwd())
        try:
            rows = []
            longest = None
            for t in turns:
                http = Http(server.url)  # a fresh connection: the last one idled past keep-alive
                status, body = http.request("POST", "/sessions", b"")
                assert status == 200, body
                sid = json.loads(body)["session_id"]
                http.close()
                build = build_session(server.url, sid, t, args.opening_bytes)
                assert not build.failures, build.failures
                http = Http(server.url)
                status, get_body = http.request("GET", f"/sessions/{sid}")
                http.close()
                assert status == 200
                disk = (tmp / "data" / "sessions" / f"{sid}.journal").stat().st_size
                packed, n = final_sequence_bytes(get_body, row)
                rows.append((t, n, disk, packed, len(get_body), build.latencies))
                longest = (sid, len(get_body), build.latencies)
            print(f"R3 {args.r3_layers} x {args.r3_topk} int32 per token ({row} bytes packed)")
            print("| turns | tokens | journal bytes | final sequence packed | ratio | records GET bytes |")
            print("|---|---|---|---|---|---|")
            for t, n, disk, packed, get_len, _lat in rows:
                print(f"| {t} | {n} | {disk:,} | {packed:,} | **{disk / packed:.3f}** | {get_len:,} |")
            if len(rows) > 1:
                print(f"disk x{rows[-1][2] / rows[-2][2]:.2f} for turns x{rows[-1][0] / rows[-2][0]:.2f}")
            assert longest is not None
            sid, size, latencies = longest
            floor_file = tmp / "floor.bin"
            with open(floor_file, "wb") as f:
                f.truncate(size)
                f.write(b"x")
            floor = SendfileFloor(floor_file)
            buf = bytearray(4 * MiB)
            gets, floors = [], []
            addr = (server.url.split("//")[1].split(":")[0], int(server.url.rsplit(":", 1)[1]))
            for _ in range(args.reps):
                g = read_get(addr, f"/sessions/{sid}", buf)
                assert g.complete, g
                gets.append(g.mib_s)
                floors.append(floor.get(buf).mib_s)
            floor.close()
            g50, f50 = statistics.median(gets), statistics.median(floors)
            print(f"GET of {size / MiB:.1f} MiB: {g50:.0f} MiB/s (runs {', '.join(f'{x:.0f}' for x in gets)}); "
                  f"sendfile floor {f50:.0f} MiB/s (runs {', '.join(f'{x:.0f}' for x in floors)}); "
                  f"ratio **x{g50 / f50:.2f}**")
            tenth = max(1, len(latencies) // 10)
            parts = {"first": latencies[:tenth], "middle": latencies[len(latencies) // 2:len(latencies) // 2 + tenth],
                     "last": latencies[-tenth:]}
            print("chat latency by turn index (ms, mean of each tenth): " + ", ".join(
                f"{k} {1000 * statistics.mean(v):.1f}" for k, v in parts.items()))
        finally:
            server.close()
        replay_bytes(tmp, args)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
