"""`drafthead serve`: an OpenAI-compatible server on the exact engine (docs/serving.md).

api.py      request bodies -> checked asks; answers -> OpenAI's replies and stream chunks
text.py     an answer's text as its tokens arrive (stop strings held back)
engine.py   the engine thread: continuous batching over the decoder
http.py     the endpoints, errors, streaming, disconnects, shutdown
metrics.py  GET /metrics in Prometheus' text format
"""
