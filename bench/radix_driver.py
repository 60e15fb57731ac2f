"""Runs in Dynamo's environment (.venv-dynamo): feeds pre-built events to Dynamo's Rust RadixTree.

    python radix_driver.py EVENTS.jsonl QUERY.json REPEATS

Each line of EVENTS.jsonl is [worker_id, event JSON as Dynamo's RadixTree takes it]. Prints one
JSON line: ingest seconds and per-query match seconds.
"""

import json
import sys
import time

from dynamo._core import RadixTree


def main():
    events_path, query_path, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with open(events_path) as f:
        events = [(w, e.encode()) for w, e in (json.loads(line) for line in f)]
    query = json.load(open(query_path))
    tree = RadixTree()
    t0 = time.perf_counter()
    for worker, event in events:
        tree.apply_event(worker, event)
    ingest = time.perf_counter() - t0
    matches = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        scores = tree.find_matches(query)
        matches.append(time.perf_counter() - t0)
    print(json.dumps({"ingest_s": ingest, "events": len(events), "match_s": matches,
                      "workers_matched": len(scores.scores)}))


if __name__ == "__main__":
    main()
