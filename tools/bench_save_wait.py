"""How long a request waits for a snapshot save still streaming the rows it overwrites.

    python tools/bench_save_wait.py [--model default] [--tokens 2000]

Request A (cold, N tokens) is answered; its snapshot save starts in the background; the next
request arrives at once. Prints `timings.save_wait_ms` for three kinds of next request:
  * a follow-up (A + its answer + new tokens): never overwrites rows the save needs -> 0
  * an unrelated N-token request: overwrites every row, layer by layer behind the writer
  * A's prompt + other tokens (diverges inside the saved rows): trails the writer to its end
"""

from __future__ import annotations

import argparse
import tempfile

from edge_llm.engine import GenerationRequest
from edge_llm.runtime import load_runtime
from edge_llm.settings import Settings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--tokens", type=int, default=2000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="edge-llm-wait-") as kv:
        eng = load_runtime(Settings(model=args.model, disk_kv=kv))
        enc = eng.tokenizer.encode
        a = enc(" ".join(f"Note {i}: crate {i} holds {i * 7 % 13} lamps." for i in range(800)))[:args.tokens]
        b = enc(" ".join(f"Memo {i}: shelf {i} has {i * 5 % 11} cups." for i in range(800)))[:args.tokens]

        def run(ids: list[int]):
            return list(eng.generate(GenerationRequest(ids, max_tokens=4)))[-1]

        cases = {
            "follow-up (A + answer + new tokens)": lambda first: a + first.completion_ids + enc(" And?"),
            f"unrelated {len(b)}-token request": lambda first: b,
            "A's prompt + other tokens": lambda first: a + enc(" Different ending."),
        }
        print(f"model {eng.model_dir.name}, snapshot of {len(a)} tokens "
              f"({len(a) * eng.cache.geometry.kv_bytes_per_token / 1e6:.0f} MB of KV) still being written")
        for label, make in cases.items():
            eng.store.flush()
            eng.cache.reset()  # A is computed cold each time, so its save is fresh and pending
            for e in list(eng.store.entries()):
                e.path.unlink()
            eng.store.scan()
            first = run(a)
            t = run(make(first)).timings
            print(f"  {label:40s} save_wait_ms {t.save_wait_ms:8.1f}   cache {t.cache_source}")
        eng.store.close()


if __name__ == "__main__":
    main()
