"""The ground floor: what heads, inference and train all stand on, importing nothing of ours.

files.py         atomic writes; JSON, safetensors and GGUF read with one clear error per bad file
outdir.py        output folders: refused when not empty, locked, written beside and swapped in whole
field_types.py   the types a config dataclass declares, checked on a dict
clock.py         time spent per phase (draft, verify, ...)
target/          the frozen target: loading, identity, parts, chat rendering, images
"""
