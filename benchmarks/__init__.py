import runner  # noqa: F401  (first: its environment for POT, set before any benchmark imports POT)
