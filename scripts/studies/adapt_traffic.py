"""The served head learning from narrow traffic: `drafthead serve` with a static head against the same
server with `--adapt`, the same stream of requests sent to each, one at a time.

    .venv/bin/python scripts/studies/adapt_traffic.py --stream 240 --heldout 40 --switch 60 \\
        --max-tokens 96 --out out/adapt-traffic

The narrow traffic is one of:
- `--domain code`: ShareGPT's first user turns that ask for code (a Python, JavaScript, SQL...
  keyword near the start), in file order;
- `--domain products`: one templated product-listing prompt (title, description, three features,
  price), filled with an adjective, an item and an audience drawn with a fixed seed: the traffic
  of a shop that writes its catalogue with the model.
The first --stream requests are served, the next --heldout are kept for the held-out check; then
--switch MT-bench prompts (writing, roleplay, humanities) switch the domain. Greedy, fp32, the
shipped SmolLM2 head and its drafting, on torch's forward or llama.cpp's (`--backend llama.cpp`:
each row a KV stream, so trees are chains).

Reports:
- tau per window of 10 requests over the stream, static against adapting, with the swaps and
  rollbacks logged (versions.jsonl), and whether every answer equals the static server's (both
  are the target's own greedy output);
- the held-out gain: `drafthead gate` replays the shipped head and the final live head on the
  held-out prompts (their own answers by the target, replayed);
- after the switch: tau of both servers on the other domain;
- the trainer's CPU seconds over the wall clock, and served tokens/s with and without adapting.
Writes OUT/adapt.json, OUT/adapt.md and OUT/adapt.png.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

CODE = re.compile(r"\b(python|javascript|typescript|java|c\+\+|sql|bash|function|code|script|regex|class)\b", re.I)
WINDOW = 10


def code_prompts(n: int) -> list[str]:
    from drafthead.train.data.sources import sharegpt_chats

    out, seen = [], set()
    for chat in sharegpt_chats(20000):
        text = chat["messages"][0]["content"]
        if chat["messages"][0]["role"] == "user" and CODE.search(text[:200]) and 20 < len(text) < 1500 and text not in seen:
            seen.add(text)
            out.append(text)
            if len(out) >= n:
                break
    return out


ITEMS = (
    "backpack|water bottle|desk lamp|office chair|yoga mat|coffee grinder|electric kettle|hiking boots|rain jacket|"
    "wireless earbuds|bluetooth speaker|phone case|laptop stand|mechanical keyboard|gaming mouse|webcam|monitor arm|"
    "standing desk|air purifier|humidifier|space heater|ceiling fan|robot vacuum|cordless drill|tool box|garden hose|"
    "lawn mower|bird feeder|plant pot|throw pillow|duvet cover|bath towel|shower curtain|kitchen knife|cutting board|"
    "frying pan|dutch oven|blender|toaster|rice cooker|slow cooker|lunch box|travel mug|wine glass|tea set|"
    "picnic blanket|camping tent|sleeping bag|headlamp|trekking poles|bike helmet|bike lock|skateboard|tennis racket|"
    "football|basketball|swim goggles|dumbbell set|resistance bands|foam roller|fitness tracker|smart watch|"
    "alarm clock|wall clock|picture frame|bookshelf|shoe rack|umbrella|sunglasses|wallet|handbag|leather belt|"
    "wool scarf|winter gloves|wool socks|baby stroller|high chair|dog bed|cat tree|pet carrier|aquarium filter|"
    "electric toothbrush|hair dryer|beard trimmer|makeup mirror|scented candle|essential oil diffuser|board game|"
    "jigsaw puzzle|drone|action camera|tripod|ring light|e-reader|tablet stand|power bank|usb charger|hdmi cable|"
    "router|smart plug|doorbell camera"
).split("|")
ADJECTIVES = (
    "compact|lightweight|premium|eco-friendly|budget|heavy-duty|foldable|waterproof|minimalist|vintage|smart|portable|ergonomic|handmade|professional"
).split("|")
AUDIENCES = "students|travelers|families|office workers|runners|gamers|new parents|pet owners|home cooks|campers|seniors|small apartments".split("|")
LISTING = (
    "Write a product listing for a {adjective} {item} aimed at {audience}. Use this format:\n"
    "Title: <a catchy title>\nDescription: <two sentences>\nFeatures:\n- <feature>\n- <feature>\n- <feature>\n"
    "Price: <a price in US dollars>"
)


def product_prompts(n: int) -> list[str]:
    """n distinct fillings of the listing template (at most 15 * 100 * 12), drawn with seed 0."""
    import random

    rng, seen, out = random.Random(0), set(), []
    while len(out) < n:
        key = (rng.choice(ADJECTIVES), rng.choice(ITEMS), rng.choice(AUDIENCES))
        if key not in seen:
            seen.add(key)
            out.append(LISTING.format(adjective=key[0], item=key[1], audience=key[2]))
    return out


DOMAINS = {"code": code_prompts, "products": product_prompts}


def other_prompts(n: int) -> list[str]:
    from drafthead.inference.bench.prompts import load_prompts

    return [p.text for p in load_prompts("mt-bench") if p.category in ("writing", "roleplay", "humanities")][:n]


def ask(url: str, text: str, n: int) -> dict:
    body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": text}], "max_tokens": n, "temperature": 0, "return_token_ids": True}
    request = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=3600) as r:
        reply = json.loads(r.read())
    return {
        "ids": reply["choices"][0]["token_ids"],
        "tau": reply["drafthead"]["tau"],
        "rounds": reply["drafthead"]["rounds"],
        "seconds": time.perf_counter() - start,
    }


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    return 0.0


def worker_cpu_seconds() -> float:
    """User + system seconds of the running adapt worker (from /proc)."""
    out = subprocess.run(["pgrep", "-f", "drafthead.train.adapt.worker"], capture_output=True, text=True).stdout.split()
    total = 0.0
    for pid in out:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / 100  # utime, stime in clock ticks (100 Hz)
        except OSError:
            pass
    return total


def serve_stream(name: str, extra: list[str], texts: list[str], n: int, out: Path, args) -> tuple[list[dict], float]:
    from drafthead.inference.servers.local import local_server

    def command(port):
        backend = ["--backend", args.backend, "--dtype", "float32", "--threads", str(args.threads)]
        return [sys.executable, "-m", "drafthead", "serve", "--port", port, *backend, *extra]

    records = []
    with local_server(command, name, log=out / f"{name}.log", ready_within=600) as url:
        ask(url, "Hello", 4)  # warm-up
        start = time.perf_counter()
        for i, text in enumerate(texts):
            record = ask(url, text, n)
            record["head_version"] = metric(url, "drafthead_head_version")
            records.append(record)
            if (i + 1) % WINDOW == 0:
                taus = [r["tau"] for r in records[-WINDOW:]]
                print(f"{name} {i + 1}: tau {sum(taus) / len(taus):.3f} version {record['head_version']:.0f}", flush=True)
        wall = time.perf_counter() - start
        cpu = worker_cpu_seconds()
    return records, (cpu / wall if wall else 0.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--domain", default="code", choices=sorted(DOMAINS), help="the narrow traffic")
    parser.add_argument("--stream", type=int, default=240)
    parser.add_argument("--heldout", type=int, default=40)
    parser.add_argument("--switch", type=int, default=60)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--backend", default="torch", choices=("torch", "llama.cpp"), help="the served target's forward")
    parser.add_argument("--adapt-args", default="--adapt-min-tokens 2000 --adapt-steps 60 --adapt-lr 1e-4 --adapt-holdout 16")
    parser.add_argument("--out", default="out/adapt-traffic")
    args = parser.parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    narrow = DOMAINS[args.domain](args.stream + args.heldout)
    stream, heldout = narrow[: args.stream], narrow[args.stream :]
    switched = other_prompts(args.switch)
    texts = stream + switched
    adapt_dir = out / "adapt"
    subprocess.run(["rm", "-rf", str(adapt_dir)], check=True)
    static, _ = serve_stream("static", [], texts, args.max_tokens, out, args)
    adapting, cpu_share = serve_stream("adapting", ["--adapt", str(adapt_dir), *args.adapt_args.split()], texts, args.max_tokens, out, args)

    events = [json.loads(line) for line in (adapt_dir / "versions.jsonl").read_text().splitlines() if line.strip()]
    live = 0
    for e in events:
        if e["event"] in ("accepted", "swap"):
            live = e["version"]
        elif e["event"] == "rollback":
            live = e["version"]
    heldout_file = out / "heldout.jsonl"
    heldout_file.write_text(
        "".join(json.dumps({"messages": [{"role": "user", "content": t}, {"role": "assistant", "content": "."}]}) + "\n" for t in heldout)
    )
    from drafthead.proposers import default_head_path

    shipped, final = default_head_path("smollm2-135m"), adapt_dir / "versions" / f"v{live:04d}"
    limits = ["--limit", str(args.heldout), "--max-new-tokens", str(args.max_tokens), "--json"]
    gate_command = [sys.executable, "-m", "drafthead", "gate", "--live", str(shipped), "--candidate", str(final), "--data", str(heldout_file)]
    gate = subprocess.run(gate_command + limits, capture_output=True, text=True)
    held = json.loads(gate.stdout.strip().splitlines()[-1]) if gate.stdout.strip() else {"error": gate.stderr[-400:]}

    def window_taus(records):
        return [round(sum(r["tau"] for r in records[i : i + WINDOW]) / len(records[i : i + WINDOW]), 3) for i in range(0, len(records), WINDOW)]

    def tokens_per_s(records):
        return sum(len(r["ids"]) for r in records) / sum(r["seconds"] for r in records)

    n = len(stream)
    summary = {
        "settings": vars(args),
        "identical": sum(a["ids"] == b["ids"] for a, b in zip(static, adapting)),
        "requests": len(texts),
        "windows": {
            "static": window_taus(static),
            "adapting": window_taus(adapting),
            "version": [r["head_version"] for r in adapting[WINDOW - 1 :: WINDOW]],
        },
        "stream_tau": {"static": _tau(static[:n]), "adapting": _tau(adapting[:n]), "adapting_last_100": _tau(adapting[max(0, n - 100) : n])},
        "switched_tau": {"static": _tau(static[n:]), "adapting": _tau(adapting[n:])},
        "heldout_gate": held,
        "events": [{k: e[k] for k in ("event", "version", "parent", "previous", "from") if k in e} | {"gate": e.get("gate")} for e in events],
        "trainer_cpu_share": round(cpu_share, 3),
        "tokens_per_s": {"static": round(tokens_per_s(static), 2), "adapting": round(tokens_per_s(adapting), 2)},
    }
    (out / "adapt.json").write_text(json.dumps(summary, indent=1) + "\n")
    lines = [
        f"| requests | {summary['requests']} ({n} {args.domain}, then {len(switched)} other) | identical answers | {summary['identical']} |",
        "| --- | --- | --- | --- |",
        f"| stream tau static | {summary['stream_tau']['static']:.3f} | stream tau adapting | {summary['stream_tau']['adapting']:.3f} |",
        f"| last 100 of the stream, adapting | {summary['stream_tau']['adapting_last_100']:.3f} | held-out gate | {held} |",
        f"| after the switch, static | {summary['switched_tau']['static']:.3f} "
        f"| after the switch, adapting | {summary['switched_tau']['adapting']:.3f} |",
        f"| tokens/s static | {summary['tokens_per_s']['static']} | tokens/s adapting | {summary['tokens_per_s']['adapting']} |",
        f"| trainer CPU share | {summary['trainer_cpu_share']} | events | {len(events)} |",
    ]
    (out / "adapt.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(summary, n, out / "adapt.png")
    return 0


def _tau(records) -> float:
    rounds = sum(r["rounds"] for r in records)
    return sum(len(r["ids"]) for r in records) / rounds if rounds else 0.0


def plot(summary: dict, stream: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name in ("static", "adapting"):
        taus = summary["windows"][name]
        ax.plot([WINDOW * (i + 1) for i in range(len(taus))], taus, marker="o", ms=3, label=name)
    ax.axvline(stream, color="grey", ls="--", lw=1)
    ax.text(stream, ax.get_ylim()[1], " domain switch", va="top", fontsize=8)
    ax.set_xlabel("requests served")
    ax.set_ylabel(f"tau (mean over {WINDOW} requests)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
