"""The typed client of the gateway's `/v1/art` API: the one way the trainer, the CLI and the demo call it.

It sends and reads the server's own structs (store/api.py), never copies of them, and loads no web server.
"""

from client.art import ArtClient, GatewayRefused, NotAnArtGateway, error_message

__all__ = ["ArtClient", "GatewayRefused", "NotAnArtGateway", "error_message"]
