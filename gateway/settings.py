"""Gateway settings: one typed, immutable object, read once (from the CLI and `ARTGW_*`).

Each field declares its command-line option here, once: `metadata["help"]` is its `--help` line, and
artgw/options.py derives the flag (`--field-name`) and the variable (`ARTGW_FIELD_NAME`) from the name.
`__post_init__` rejects bad values with a message naming the option; nothing is clamped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

LogLevel = Literal["debug", "info", "warning", "error", "critical"]
JournalFsync = Literal["always", "interval", "never"]  # gateway/journal.py's FsyncPolicy


def served_base_name(base_model: str) -> str:
    """The name vLLM serves the base weights under: a local dir's name, or the hub id as is."""
    path = Path(base_model)
    return path.name if path.exists() else base_model


def _positive(value: float) -> bool:
    return math.isfinite(value) and value > 0  # written so NaN fails too


@dataclass(frozen=True)
class Settings:
    model_name: str = field(
        default="my-agent", metadata={"help": "the trainable model name clients put in 'model' (no '@' or '/')"}
    )
    base_model: str | None = field(
        default=None, metadata={"help": "model path or hub id: the gateway starts and supervises vLLM with it"}
    )
    upstream: str | None = field(
        default=None, metadata={"help": "URL of a vLLM OpenAI server already running (instead of --base-model)"}
    )
    host: str = field(
        default="127.0.0.1",
        metadata={"help": "address the gateway listens on; `status` and `train` reach it there unless --gateway"},
    )
    port: int = field(
        default=8000,
        metadata={"help": "port the gateway listens on; `status` and `train` reach it there unless --gateway"},
    )
    data_dir: Path = field(
        default=Path("data"), metadata={"help": "where the SQLite store, logs, checkpoints and spill files live"}
    )
    db: str | None = field(
        default=None,
        metadata={
            "help": "SQLAlchemy URL of the store, e.g. postgresql+asyncpg://user:pw@host/db "
            "(none: SQLite in DATA_DIR/artgw.sqlite)"
        },
    )
    # The variable was ARTGW_NO_MIGRATE before this became a --migrate/--no-migrate pair; compose sets it.
    migrate: bool = field(
        default=True,
        metadata={"help": "run the store's Alembic migrations on start", "inverse_env": "ARTGW_NO_MIGRATE"},
    )
    admin_key: str | None = field(
        default=None,
        metadata={"help": "bearer key guarding the /v1/art admin endpoints (none: loopback clients only)"},
    )
    engine_port: int = field(
        default=0, metadata={"help": "port of the supervised vLLM server (0: a free port chosen at start)"}
    )
    engine_args: tuple[str, ...] = field(
        default=(), metadata={"help": "extra arguments for the supervised vLLM, one shell-quoted string"}
    )
    max_lora_rank: int = field(default=16, metadata={"help": "vLLM's --max-lora-rank: the largest LoRA rank it loads"})
    max_model_len: int = field(default=4096, metadata={"help": "vLLM's --max-model-len"})
    engine_startup_timeout: float = field(default=600.0, metadata={"help": "seconds to wait for vLLM to start"})
    request_timeout: float = field(default=600.0, metadata={"help": "seconds to wait for the engine's answer"})
    max_body_bytes: int = field(default=16 * 1024 * 1024, metadata={"help": "largest request body accepted (bytes)"})
    # Read timeouts of the gateway's own server (gateway/server.py): a client can't hold a connection forever.
    keep_alive_timeout: float = field(
        default=5.0,
        metadata={"help": "seconds a connection may sit idle (before its first request or between requests)"},
    )
    header_timeout: float = field(
        default=10.0, metadata={"help": "seconds from a request's first byte to the end of its head (then 408)"}
    )
    body_timeout: float = field(
        default=60.0,
        metadata={"help": "seconds to receive a whole request body once its head is in (a total; then 408)"},
    )
    recorder_queue_size: int = field(
        default=10_000,
        metadata={"help": "records kept in memory for the store writer; past it they wait in the journal only"},
    )
    recorder_queue_bytes: int = field(
        default=64 << 20,
        metadata={"help": "bytes of records (journal size) kept in memory; past it they wait in the journal only"},
    )
    journal_fsync: JournalFsync = field(
        default="never",
        metadata={
            "help": "when the record journal is fsynced: never (survives a gateway crash, SIGKILL or OOM, not "
            "power loss), interval (power loss may take the last --journal-fsync-interval), always (before "
            "each answer ends; slow)"
        },
    )
    journal_fsync_interval: float = field(
        default=1.0, metadata={"help": "seconds between journal fsyncs with --journal-fsync interval"}
    )
    journal_segment_bytes: int = field(
        default=64 << 20, metadata={"help": "the record journal starts a new segment file past this size"}
    )
    recorder_batch_size: int = field(default=256, metadata={"help": "most calls recorded in one store transaction"})
    recorder_cache_bytes: int = field(
        default=64 << 20,
        metadata={
            "help": "bytes of memory (all rollouts together) for recent calls, against which a rollout's next "
            "call is stored compactly"
        },
    )
    log_level: LogLevel = field(default="info", metadata={"help": "the gateway's log level"})
    # Set by code (tests give the supervised engine extra variables), never by a user.
    extra_env: dict[str, str] = field(default_factory=dict, metadata={"option": False})

    def __post_init__(self) -> None:
        if (self.base_model is None) == (self.upstream is None):
            raise ValueError("give exactly one of --base-model (supervise vLLM) or --upstream (use a running vLLM)")
        if not self.model_name or "@" in self.model_name or "/" in self.model_name:
            raise ValueError(f"invalid --model-name {self.model_name!r}: no '@' or '/', not empty")
        if self.upstream is not None and not self.upstream.startswith(("http://", "https://")):
            raise ValueError(f"--upstream must be an http:// or https:// URL, got {self.upstream!r}")
        if not self.host:
            raise ValueError("--host must not be empty")
        for flag, port in (("--port", self.port), ("--engine-port", self.engine_port)):
            if not 0 <= port <= 65535:
                raise ValueError(f"{flag} must be a port number (0-65535), got {port}")
        for flag, count in (
            ("--max-lora-rank", self.max_lora_rank),
            ("--max-model-len", self.max_model_len),
            ("--max-body-bytes", self.max_body_bytes),
            ("--recorder-queue-size", self.recorder_queue_size),
            ("--recorder-batch-size", self.recorder_batch_size),
            ("--recorder-cache-bytes", self.recorder_cache_bytes),
            ("--recorder-queue-bytes", self.recorder_queue_bytes),
            ("--journal-segment-bytes", self.journal_segment_bytes),
        ):
            if count < 1:
                raise ValueError(f"{flag} must be >= 1, got {count}")
        for flag, seconds in (
            ("--engine-startup-timeout", self.engine_startup_timeout),
            ("--request-timeout", self.request_timeout),
            ("--journal-fsync-interval", self.journal_fsync_interval),
            ("--keep-alive-timeout", self.keep_alive_timeout),
            ("--header-timeout", self.header_timeout),
            ("--body-timeout", self.body_timeout),
        ):
            if not _positive(seconds):
                raise ValueError(f"{flag} must be a number of seconds > 0, got {seconds}")
        if self.journal_fsync not in get_args(JournalFsync):
            raise ValueError(
                f"--journal-fsync must be one of {', '.join(get_args(JournalFsync))}, got {self.journal_fsync!r}"
            )
        if self.log_level not in get_args(LogLevel):
            raise ValueError(f"--log-level must be one of {', '.join(get_args(LogLevel))}, got {self.log_level!r}")

    @property
    def db_url(self) -> str:
        return self.db or f"sqlite+aiosqlite:///{(self.data_dir / 'artgw.sqlite').resolve()}"

    @property
    def upstream_url(self) -> str:
        return self.upstream.rstrip("/") if self.upstream else f"http://127.0.0.1:{self.engine_port}"
