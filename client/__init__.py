"""The typed client of the gateway's `/v1/art` API: what the trainer (and, in time, the CLI and the demo) call.

It sends and reads the server's own structs (store/types.py), never copies of them, and loads no web server.
"""

from client.art import ArtClient, GatewayRefused

__all__ = ["ArtClient", "GatewayRefused"]
