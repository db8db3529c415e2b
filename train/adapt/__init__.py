"""The served head learns from the traffic it serves (`drafthead serve --adapt DIR`, docs/serving.md
"Adapting to the traffic"), and the same loop offline (`drafthead gate`, docs/training.md).

    buffer.py    the served answers and the target's hidden states at them, as capture shards
    worker.py    the background trainer: a candidate from the live head, then the gate
    gate.py      replayed acceptance of the live and the candidate head on held-out traffic
    versions.py  every head version and the log that says which one is live
    live.py      the server's side: recording, swapping an accepted head in, rolling a worse one back
"""
