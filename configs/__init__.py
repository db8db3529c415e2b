"""Run presets (YAML), accelerate launch configs and target shapes: data only, installed as
drafthead.configs so that `drafthead train --config NAME` finds a preset from any folder."""
