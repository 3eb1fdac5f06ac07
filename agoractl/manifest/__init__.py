"""The run manifest: its schema (pydantic), the YAML loader with --set overrides, and the plan (parameters, memory, bytes, bandwidth)."""
