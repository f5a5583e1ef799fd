"""Samples assembly (``webapp.samples.assemble_samples``) in process, by session length.

    python bench/samples_assembly.py [--turns 50 100 200] [--obs-tokens 1250] [--repeats 5]
                                     [--against DIR]

Builds a synthetic linear session per turn count: each turn's prompt adds an observation of
``--obs-tokens`` ids (a screenshot's image pads and its text are ~1,250 ids), each reply 40
ids, every turn completed, so the sample merges every turn (the viewer's cold open and
``POST /samples`` pay exactly this). Prints the median wall time of ``--repeats`` assemblies.
``--against DIR``: the same measurement, in the same run, of the ``webapp`` package in
checkout DIR (a subprocess with DIR first on ``sys.path``), and the ratio. Reports figures;
gates nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time


def measure(turn_counts: list[int], obs_tokens: int, repeats: int) -> dict[int, float]:
    from webapp.samples import TurnRecord, assemble_samples
    from webapp.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(None)
    rng = random.Random(1)
    result = {}
    for turns in turn_counts:
        records, ids = [], []
        for i in range(turns):
            ids += [rng.randrange(32, 127) for _ in range(obs_tokens)]  # printable: valid text
            out = tuple(rng.randrange(32, 127) for _ in range(40))
            records.append(TurnRecord(prompt_len=len(ids), output_ids=out, logprobs=(-0.5,) * len(out),
                                      finish_reason="stop", meta={}, timestamp=1.0 + i,
                                      request_timestamp=0.5 + i, replay=()))
            ids += out
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            samples, _ = assemble_samples(records, ids, tokenizer, max_seq_len=None)
            times.append(time.perf_counter() - started)
        assert len(samples[0].tokens) == len(ids)
        result[turns] = statistics.median(times)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, nargs="+", default=[50, 100, 200])
    parser.add_argument("--obs-tokens", type=int, default=1250)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--against", default=None, help="another checkout whose webapp to measure in the same run")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # the --against child's output
    args = parser.parse_args()
    if args.json:
        print(json.dumps(measure(args.turns, args.obs_tokens, args.repeats)))
        return
    other = None
    if args.against:
        env = {**os.environ, "PYTHONPATH": os.path.abspath(args.against)}
        child = subprocess.run([sys.executable, __file__, "--json", "--turns", *map(str, args.turns),
                                "--obs-tokens", str(args.obs_tokens), "--repeats", str(args.repeats)],
                               env=env, capture_output=True, text=True, check=True)
        other = {int(k): v for k, v in json.loads(child.stdout).items()}
    ours = measure(args.turns, args.obs_tokens, args.repeats)
    print(f"load {os.getloadavg()[0]:.1f}; {args.obs_tokens} observation ids + 40 reply ids per turn")
    for turns in args.turns:
        line = f"{turns:4d} turns: {ours[turns] * 1000:8.1f} ms"
        if other is not None:
            line += f"   against {args.against}: {other[turns] * 1000:8.1f} ms   ratio x{other[turns] / ours[turns]:.1f}"
        print(line)


if __name__ == "__main__":
    main()
