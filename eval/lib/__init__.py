"""The evaluation library: data, harness, kv_modes, kvprobe (no command of its own; eval/__init__.py has the map)."""
