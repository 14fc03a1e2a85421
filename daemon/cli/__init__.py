"""The daemon's subcommands: `ridge serve` (serve.py, configured by config.py), `chat`, `status`,
`models` and `gateway` (commands.py), `ridge generate` (generate.py) and `ridge service`
(service.py). The Python clients they use are daemon/client.py and daemon/aio_client.py."""
