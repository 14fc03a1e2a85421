"""The daemon's transport: what a ZeroMQ client reaches and how it is kept (docs/protocol.md §1,
§4, §10). The socket loop (loop.py: sockets, receiving, sending, liveness sweeps, the drain),
the endpoints and their locks and CURVE keys (endpoint.py), a connected client (peers.py), who
it is and what it shares (sharing.py), systemd's notifications (notify.py), and the pipe other
threads wake the socket thread with (wake.py). Nothing here reads a request's body."""
