"""The official `openai` client against `drafthead serve` on SmolLM2-135M: chat, streamed chat and
completions from the speculative server (the shipped head) against the plain one (`--proposer
none`), at temperature 0, and the same chats sent 16 at a time against one at a time.

    .venv/bin/python scripts/studies/serve_clients.py --limit 16 --max-tokens 64 --out out/serve-clients

Both servers run on the same backend, dtype and threads (llama.cpp f32 by default). Counts how many
answers of each kind are equal, token for token where the server returns ids, text for text for the
stream. Writes OUT/clients.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MODEL = "smollm2-135m"


def server(args, name: str, flags: list[str], out: Path):
    from drafthead.inference.servers.local import local_server

    common = ["--backend", args.backend, "--dtype", "float32", "--threads", str(args.threads), "--max-batch", "16"]

    def command(port):
        return [sys.executable, "-m", "drafthead", "serve", "--port", port, *common, *flags]

    return local_server(command, name, log=out / f"{name}.log", ready_within=900)


def answers(url: str, texts: list[str], n: int, concurrency: int) -> dict[str, list]:
    """Each text as a chat (ids), a streamed chat (text) and a completion (ids), `concurrency` at a time."""
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="none", timeout=3600)

    def chat(text):
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=n, temperature=0, extra_body={"return_token_ids": True}
        )
        return r.choices[0].model_extra["token_ids"]

    def streamed(text):
        stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=n, temperature=0, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    def completion(text):
        r = client.completions.create(model=MODEL, prompt=text, max_tokens=n, temperature=0, extra_body={"return_token_ids": True})
        return r.choices[0].model_extra["token_ids"]

    with ThreadPoolExecutor(concurrency) as pool:
        return {kind: list(pool.map(fn, texts)) for kind, fn in (("chat", chat), ("stream", streamed), ("completion", completion))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--backend", default="llama.cpp", choices=("llama.cpp", "torch"))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default="out/serve-clients")
    args = parser.parse_args()

    from drafthead.inference.bench.prompts import load_prompts

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    texts = [p.text for p in load_prompts("mt-bench", args.limit)]
    with server(args, "plain", ["--proposer", "none"], out) as url:
        plain = answers(url, texts, args.max_tokens, 1)
    with server(args, "head", [], out) as url:
        alone = answers(url, texts, args.max_tokens, 1)
        together = answers(url, texts, args.max_tokens, 16)
    summary = {"settings": vars(args), "prompts": len(texts)}
    for kind in plain:
        summary[kind] = {
            "head_alone_equals_plain": sum(a == b for a, b in zip(alone[kind], plain[kind])),
            "head_16_in_flight_equals_alone": sum(a == b for a, b in zip(together[kind], alone[kind])),
            "differ": [i for i, (a, b) in enumerate(zip(alone[kind], plain[kind])) if a != b],
        }
    (out / "clients.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
