"""The web UI at /ui: server-rendered pages over the API's services, behind the API's keys (`read` scope)."""

from gateway.ui.routes import TEMPLATE_CONFIG, router

__all__ = ["TEMPLATE_CONFIG", "router"]
