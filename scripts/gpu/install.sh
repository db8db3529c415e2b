# Sourced by scripts/gpu/check.sh and scripts/gpu/run.sh. `install WHEELS`: the wheels
# scripts/gpu/stage.py staged (the packages WHEELS/wanted.txt names and what they need) into $PY's
# environment offline, resolved against the image's packages (every wheel with --no-deps where
# that fails), then drafthead itself, editable; prints the versions it ended with.
install() {
    local wheels=$1
    "$PY" -m pip install -q --no-index --find-links "$wheels" -r "$wheels/wanted.txt" \
        || { echo "resolution failed: installing every staged wheel with --no-deps"; \
             "$PY" -m pip install -q --no-index --no-deps "$wheels"/*.whl; } || return 1
    "$PY" -m pip install -q --no-deps --no-build-isolation -e . || return 1
    "$PY" -m pip check || true  # what the image's other packages now lack; for the log
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    "$PY" -c "import torch, transformers, datasets, accelerate, drafthead; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'transformers', transformers.__version__, 'datasets', datasets.__version__, 'accelerate', accelerate.__version__)"
}
