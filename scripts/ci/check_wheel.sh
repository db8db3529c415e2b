#!/usr/bin/env bash
# The built wheel works outside the checkout: build it, install it into a fresh venv, and from an
# empty folder run the CLI end to end on a tiny target (preset by name, train, export, generate).
# The fresh venv borrows the third-party packages of the project's .venv (a .pth line) so that the
# check costs seconds, not a reinstall of torch; drafthead itself comes only from the wheel.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DEPS_PY="$ROOT/.venv/bin/python"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

"$DEPS_PY" -m pip wheel -q --no-deps -w "$WORK/dist" "$ROOT" > "$WORK/wheel.log" 2>&1 || { cat "$WORK/wheel.log"; exit 1; }
WHEEL=$(ls "$WORK"/dist/drafthead-*.whl)

python3 -m venv "$WORK/venv"
SITE=$("$WORK/venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
DEPS=$("$DEPS_PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
echo "$DEPS" > "$SITE/project_deps.pth"  # appended after the venv's own site-packages
"$WORK/venv/bin/python" -m pip install -q --no-deps "$WHEEL" 2>&1 | grep -v "^WARNING: Location" || true

cd "$WORK"  # no checkout here: everything must come from the installed wheel
export PATH="$WORK/venv/bin:$PATH" OMP_NUM_THREADS=1
where=$(python -c "import drafthead.heads, drafthead.configs; print(drafthead.heads.__file__)")
case "$where" in "$WORK"/venv/*) ;; *) echo "drafthead imported from $where, not the wheel"; exit 1;; esac
drafthead --help > /dev/null
drafthead data tiny-target --out tiny
drafthead train --config tiny-eagle3 target=tiny data.path=tiny/chats.jsonl output_dir=run max_steps=2 checkpoint_every=0 eval_every=0
drafthead export run/final --format ours --out exported
drafthead export run/final --format vllm --out exported-vllm  # the README's first path reaches an engine layout
drafthead generate --target tiny --proposer head --head exported --prompt "hello" --max-new-tokens 8 --dtype float32
# transformers' generate() with the wheel's custom_generate folder: the head drafts, the output is plain greedy's
python - <<'PY'
from transformers import AutoModelForCausalLM
from drafthead.hf_generate import CUSTOM_GENERATE

model = AutoModelForCausalLM.from_pretrained("tiny").eval()
ids = model.generation_config.bos_token_id
prompt = __import__("torch").tensor([[ids, 10, 11, 12, 10, 11]])
plain = model.generate(prompt, do_sample=False, max_new_tokens=8, eos_token_id=None, pad_token_id=0)
ours = model.generate(prompt, do_sample=False, max_new_tokens=8, eos_token_id=None, pad_token_id=0,
                      custom_generate=CUSTOM_GENERATE, trust_remote_code=True, draft_head="exported")
assert ours.shape == (1, 14), ours.shape
assert ours.tolist() == plain.tolist(), (ours.tolist(), plain.tolist())
PY
echo "wheel check: ok ($(basename "$WHEEL"))"
