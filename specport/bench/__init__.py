"""`specport bench`: artifact latency and throughput, peers side by side, speculation, engine load, and the kernel floor."""
