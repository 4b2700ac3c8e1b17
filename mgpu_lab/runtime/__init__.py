"""Where code runs: devices and backends, the process group, launching ranks."""
