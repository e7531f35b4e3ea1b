"""Gateway settings: one typed, immutable object, read once (from the CLI and `ARTGW_*`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


def served_base_name(base_model: str) -> str:
    """The name vLLM serves the base weights under: a local dir's name, or the hub id as is."""
    path = Path(base_model)
    return path.name if path.exists() else base_model


@dataclass(frozen=True)
class Settings:
    model_name: str  # the trainable model clients ask for
    base_model: str | None = None  # path or hub id: the gateway starts and supervises vLLM
    upstream: str | None = None  # URL of a vLLM server that is already running
    host: str = "127.0.0.1"
    port: int = 8000
    data_dir: Path = Path("data")
    db: str | None = None  # SQLAlchemy URL; None = SQLite under data_dir
    migrate: bool = True  # run Alembic migrations on start
    admin_key: str | None = None
    engine_port: int = 0  # 0: a free port chosen at start
    engine_args: tuple[str, ...] = ()
    max_lora_rank: int = 16
    max_model_len: int = 4096
    engine_startup_timeout: float = 600.0
    request_timeout: float = 600.0  # seconds to wait for the engine's answer
    max_body_bytes: int = 16 * 1024 * 1024
    recorder_queue_size: int = 10_000
    recorder_batch_size: int = 256
    extra_env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.base_model is None) == (self.upstream is None):
            raise ValueError("give exactly one of --base-model (supervise vLLM) or --upstream (use a running vLLM)")
        if not self.model_name or "@" in self.model_name or "/" in self.model_name:
            raise ValueError(f"invalid --model-name {self.model_name!r}: no '@' or '/', not empty")

    @property
    def db_url(self) -> str:
        return self.db or f"sqlite+aiosqlite:///{(self.data_dir / 'artgw.sqlite').resolve()}"

    @property
    def upstream_url(self) -> str:
        return self.upstream.rstrip("/") if self.upstream else f"http://127.0.0.1:{self.engine_port}"
