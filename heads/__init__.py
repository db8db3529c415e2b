"""Draft heads: Medusa, Hydra, EAGLE-1/3, P-EAGLE, DFlash, DSpark and MTP; their configs, losses,
save/load and export. Each name is imported from its own module (`heads.registry` builds and loads
heads, `heads.config` holds the configs and `KINDS`, `heads.formats` exports and imports), so
importing one of them loads only what it needs."""
