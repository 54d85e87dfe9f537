"""Method configs: one dataclass per method, its defaults and checks (the `method` group's schemas)."""
