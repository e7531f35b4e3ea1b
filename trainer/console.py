"""The trainer's one console (stderr): what every module of the trainer prints goes through it, so that a test
captures all of it in one place."""

from rich.console import Console

console = Console(stderr=True)
