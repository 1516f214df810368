"""The `casp` command, the one place that wires the library, the API, the workers and what they share: the
library's commands (prune, eval), the service's (serve, worker, keys, demo) and the client's (submit, status,
wait, download)."""
