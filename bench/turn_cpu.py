"""CPU time of one ``SessionCore.chat`` turn, in process: the core's own work per turn.

    python bench/turn_cpu.py [--rounds 7] [--turns 150] [--replay-backend]

Each round is one session of ``--turns`` turns growing like an agent loop (the reply appended,
then a short observation) against an in-process backend returning the reference backend's
reply (R3 4 layers x top-8, through the ``sglang`` dialect); prints the CPU milliseconds per
turn (``time.process_time``), min and median over the rounds. CPU time, not wall time, so a
loaded machine shifts it less; compare trees by pointing PYTHONPATH at the other one.

``--replay-backend``: the backend's replies are computed once (a first, unmeasured round) and
replayed by request bytes, so the figure is the server's own work per turn (parsing the reply,
TITO, the journal in the core's private temporary directory) without the reference backend's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from webapp.backend import BackendReply
from webapp.core import SessionCore
from webapp.reference_backend import R3Shape, reference_completion
from webapp.tokenizers import ByteChatTokenizer

TOK = ByteChatTokenizer()
R3 = R3Shape(layers=4, top_k=8)


class InProcessBackend:
    def __init__(self, replay: bool = False) -> None:
        self.replies: dict[bytes, bytes] | None = {} if replay else None

    def send(self, path: str, payload: bytes, *, deadline: float | None = None) -> BackendReply:
        raw = self.replies.get(payload) if self.replies is not None else None
        if raw is None:
            request = json.loads(payload)
            raw = json.dumps(reference_completion(request["input_ids"], TOK, want_r3=True, r3=R3)).encode()
            if self.replies is not None:
                self.replies[payload] = raw
        return BackendReply.from_raw(raw)

    # The name the backend client's call had before the dialects (an older tree, via PYTHONPATH).
    def chat_completions(self, payload: bytes, *, deadline: float | None = None) -> BackendReply:
        return self.send("/v1/chat/completions", payload, deadline=deadline)

    def close(self) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--turns", type=int, default=150)
    parser.add_argument("--replay-backend", action="store_true", help="replay the backend's replies (see above)")
    args = parser.parse_args()
    backend = InProcessBackend(args.replay_backend)
    core = SessionCore(TOK, backend, routing_replay_layers=R3.layers)  # type: ignore[arg-type]
    per_turn = []
    for round_ in range(args.rounds + int(args.replay_backend)):
        sid = json.loads(core.create_session().body)["session_id"]
        messages = [{"role": "user", "content": "Click the OK button."}]
        started = time.process_time()
        for i in range(args.turns):
            reply = core.chat(sid, json.dumps({"messages": messages}).encode())
            assert reply.status == 200, reply.read()
            messages += [json.loads(reply.read())["choices"][0]["message"], {"role": "user", "content": f"obs {i}"}]
        if round_ or not args.replay_backend:  # the first round of a replay only records the replies
            per_turn.append((time.process_time() - started) / args.turns * 1e3)
        core.delete_session(sid)
    core.close()
    print(f"CPU per turn: min {min(per_turn):.3f} ms, median {statistics.median(per_turn):.3f} ms "
          f"({args.rounds} rounds x {args.turns} turns)")


if __name__ == "__main__":
    main()
