"""What is wanted: YAML with positions, schemas, typed volumes, config,
diagnostics, units, trust checks. Reads files, runs nothing."""
