"""Intra-op thread settings of verifier and drafter on one host: GAD through `serve all --processes`.

    python bench/bench_threads.py                        # 40 UA-GEC sentences, the default settings grid
    python bench/bench_threads.py --settings 2,2 1,1     # verifier,drafter threads (0,0: the default split)

Each setting is its own `specdec serve all --processes --verifier-threads V --drafter-threads D` (the
trained bundle, onnxruntime, fp32), all started before timing, so the rounds interleave them: each
round decodes every 5th sentence through every setting in turn. Two loads: one request in flight
(latency), and two clients at once (drafter and verifier forwards of different requests overlap,
as they do with any concurrency or with overlapped drafting). Outputs must equal across settings.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

REPO = Path(__file__).resolve().parents[1]
ROUNDS = 5
CONFIG = {"mode": "gad", "k": 10, "max_new_tokens": 200}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", default=str(REPO / "bundles" / "ua-gec"))
    p.add_argument("--sample", type=int, default=40)
    p.add_argument("--settings", nargs="+", default=["2,2", "1,1", "2,1", "1,2"],
                   help="verifier,drafter intra-op threads per stack (0: chosen by serve all)")
    args = p.parse_args()
    from evaluation.benchmark import select_sentences
    from seq2seq_models.tokenizer import Tokenizer
    from training.data import load_test_set

    tok = Tokenizer.load(Path(args.bundle) / "tokenizer.model")
    texts = [s.source for s in select_sentences(load_test_set(), tok, 255, args.sample)]
    stacks = {s: _start(args.bundle, *map(int, s.split(","))) for s in args.settings}
    try:
        for _, address in stacks.values():
            for text in texts[:3]:
                _generate(address, text)  # warm-up
        print(f"{len(texts)} sentences, GAD k=10, {os.cpu_count()} CPUs; ms / sentence (wall / sentences)")
        print("| verifier,drafter threads | 1 client | 2 clients |")
        print("|---|---:|---:|")
        results = {name: [0.0, 0.0] for name in stacks}
        outputs: dict[str, list] = {name: [None] * len(texts) for name in stacks}
        for r in range(ROUNDS):
            part = list(range(r, len(texts), ROUNDS))
            for name, (_, address) in stacks.items():
                results[name][0] += _timed(address, texts, part, 1, outputs[name])
                results[name][1] += _timed(address, texts, part, 2, outputs[name])
        first = next(iter(outputs.values()))
        for name in stacks:
            same = "" if outputs[name] == first else " (outputs differ!)"
            one, two = (1000 * t / len(texts) for t in results[name])
            print(f"| {name} | {one:.1f} | {two:.1f} |{same}")
    finally:
        for proc, _ in stacks.values():
            proc.send_signal(signal.SIGTERM)
        for proc, _ in stacks.values():
            proc.wait(30)
    return 0


def _start(bundle: str, verifier: int, drafter: int) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "specdec", "serve", "all", "--processes", "--bundle", bundle,
           "--backend", "onnxruntime", "--verifier-threads", str(verifier), "--drafter-threads", str(drafter),
           "--gateway-addr", "127.0.0.1:0", "--verifier-addr", "127.0.0.1:0", "--drafter-addr", "127.0.0.1:0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.stdout is not None
    address = proc.stdout.readline().strip()
    if not address:
        raise RuntimeError(f"serve all exited with {proc.wait()}")
    return proc, address


def _generate(address: str, text: str) -> list[int]:
    from specdec.client import generate

    return generate(address, text, CONFIG, timeout=60)["output_ids"]


def _timed(address: str, texts: list[str], indexes: list[int], clients: int, outputs: list) -> float:
    """Wall time of decoding `indexes` with `clients` concurrent callers."""
    lanes = [indexes[i::clients] for i in range(clients)]

    def run(lane: list[int]) -> None:
        for i in lane:
            outputs[i] = _generate(address, texts[i])

    threads = [threading.Thread(target=run, args=(lane,)) for lane in lanes]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - started


if __name__ == "__main__":
    sys.exit(main())
