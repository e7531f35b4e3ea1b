"""Gateway settings: one typed, immutable object, read once (from the CLI and `ARTGW_*`).

Each field declares its command-line option here, once: `metadata["help"]` is its `--help` line, and
artgw/options.py derives the flag (`--field-name`) and the variable (`ARTGW_FIELD_NAME`) from the name.
`__post_init__` rejects bad values with a message naming the option; nothing is clamped.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from recording.journal import FsyncPolicy
from store.types import Promotion

LogLevel = Literal["debug", "info", "warning", "error", "critical"]
AuthMode = Literal["required", "off"]
Continuity = Literal["splice", "rerender"]  # how a call continuing its rollout reaches the engine (continuation.py)
LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")
HOST_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,252}[A-Za-z0-9])?")  # a DNS name or IPv4 address, no port
ADMIN_KEY_FILE = "admin_key"  # in the data dir, mode 0600: where `serve` keeps a key it made, and others find it


# A trainable model's name: what clients put in `model` (`NAME@K` names its steps), and a directory of the
# trainer's checkpoints: letters, digits and `._:-`, starting with a letter or digit (so never `.` or `..`).
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
MODEL_NAME_RULE = "1 to 128 letters, digits and `._:-`, starting with a letter or digit"


def valid_model_name(name: str) -> bool:
    return MODEL_NAME.fullmatch(name) is not None


def served_base_name(base_model: str) -> str:
    """The name vLLM serves the base weights under: a local dir's name, or the hub id as is."""
    path = Path(base_model)
    return path.resolve().name if path.exists() else base_model  # resolved: `.` has no name of its own


def _positive(value: float) -> bool:
    return math.isfinite(value) and value > 0  # written so NaN fails too


def _at_least(low: int, *counts: tuple[str, int]) -> None:
    for flag, count in counts:
        if count < low:
            raise ValueError(f"{flag} must be >= {low}, got {count}")


def _seconds(*durations: tuple[str, float]) -> None:
    for flag, seconds in durations:
        if not _positive(seconds):
            raise ValueError(f"{flag} must be a number of seconds > 0, got {seconds}")


def _one_of(flag: str, value: str, choices: Any) -> None:
    if value not in get_args(choices):
        raise ValueError(f"{flag} must be one of {', '.join(get_args(choices))}, got {value!r}")


@dataclass(frozen=True)
class ModelSettings:
    """What is served and trained: the trainable models, the base weights (or a running vLLM), and how a
    rollout's calls continue it."""

    model_names: tuple[str, ...] = field(
        default=("my-agent",),
        metadata={
            "help": "a trainable model clients put in 'model' (letters, digits, '._:-'); repeat for several on one "
            "base (more at runtime: POST /v1/art/models)",
            "flag": "--model-name",
            "repeat": True,
        },
    )
    base_model: str | None = field(
        default=None, metadata={"help": "model path or hub id: the gateway starts and supervises vLLM with it"}
    )
    upstream: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "URL of a vLLM OpenAI server already running (instead of --base-model); repeat, or give a comma "
            "list, for several engines: a rollout's calls go to the engine that served its first call, new rollouts "
            "to the least loaded one",
            "repeat": True,
        },
    )
    continuity: Continuity = field(
        default="splice",
        metadata={
            "help": "how a call that continues its rollout (the history it sent back means what the model produced) "
            "reaches the engine: splice: as token ids, the model's own sampled tokens then the new messages, so the "
            "rollout is one sequence and the model sees what training uses (needs vLLM's --enable-scale-out; "
            "without it the gateway says so and renders anew); rerender: the history rendered again by the template"
        },
    )
    rollout_pin_seconds: float = field(
        default=900.0,
        metadata={
            "help": "a rollout's calls to NAME go to the step that served its first call while that step is "
            "loaded; a rollout that called within these seconds keeps its step loaded"
        },
    )
    continuation_cache_bytes: int = field(
        default=64 << 20,
        metadata={
            "help": "bytes of memory (all rollouts together) for each rollout's last call, from whose tokens the "
            "rollout's next call goes on (--continuity splice); one not held (pushed out, a restart, another "
            "replica) is read from the store"
        },
    )
    continuation_read_seconds: float = field(
        default=1.0,
        metadata={
            "help": "how long a call that continues its rollout waits for the store to give the rollout's last "
            "call when this gateway does not hold it (a restart, another replica); past it the call is rendered "
            "anew and starts a new sequence (--continuity splice)"
        },
    )

    @property
    def upstream_urls(self) -> tuple[str, ...]:
        """Each --upstream engine's URL (a value may be a comma list), without a trailing slash."""
        return tuple(url.strip().rstrip("/") for value in self.upstream for url in value.split(","))

    def check_models(self) -> None:
        if (self.base_model is None) == (not self.upstream):
            raise ValueError("give exactly one of --base-model (supervise vLLM) or --upstream (use a running vLLM)")
        if self.base_model is not None and self.base_model.startswith(("/", ".", "~")):  # a directory, not an id
            weights = Path(self.base_model).expanduser()
            if not (weights / "config.json").is_file():
                what = "has no config.json" if weights.is_dir() else "does not exist"
                raise ValueError(
                    f"--base-model {self.base_model}: the directory {what} (give a model directory as "
                    "save_pretrained writes one, or a model id of the hub)"
                )
        if not self.model_names:
            raise ValueError("give at least one --model-name")
        for name in self.model_names:
            if not valid_model_name(name):
                raise ValueError(f"invalid --model-name {name!r}: {MODEL_NAME_RULE}")
        if len(set(self.model_names)) != len(self.model_names):
            raise ValueError(f"--model-name given twice: {', '.join(self.model_names)}")
        urls = self.upstream_urls
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"--upstream must be an http:// or https:// URL, got {url!r}")
        if len(set(urls)) != len(urls):
            raise ValueError(f"--upstream names an engine twice: {', '.join(urls)}")
        _at_least(1, ("--continuation-cache-bytes", self.continuation_cache_bytes))
        _seconds(
            ("--rollout-pin-seconds", self.rollout_pin_seconds),
            ("--continuation-read-seconds", self.continuation_read_seconds),
        )


@dataclass(frozen=True)
class ServerSettings:
    """The HTTP server and where its data lives: address, store, limits on what a request may send, logs."""

    host: str = field(
        default="127.0.0.1",
        metadata={"help": "address the gateway listens on; `status` and `train` reach it there unless --gateway"},
    )
    port: int = field(
        default=8000,
        metadata={"help": "port the gateway listens on; `status` and `train` reach it there unless --gateway"},
    )
    workers: int = field(
        default=1,
        metadata={
            "help": "gateway processes serving the port together (SO_REUSEPORT: the kernel spreads connections); "
            "the engines are not multiplied (the first process supervises --engines of them, the others call them "
            "as --upstream URLs), one store, a journal each; a rollout's calls may land on any of them"
        },
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
    store_wait: float = field(
        default=5.0,
        metadata={
            "help": "seconds a store access waits for a lock or a connection before the call that needs it is "
            "refused (503 store_unavailable, Retry-After)"
        },
    )
    max_body_bytes: int = field(default=16 * 1024 * 1024, metadata={"help": "largest request body accepted (bytes)"})
    # Read timeouts of the gateway's own server (gateway/server.py): a client can't hold a connection forever.
    # Longer than clients' own keep-alive expiry (httpx 5 s, aiohttp 15 s) so the client ends an idle connection:
    # a server that closes it first races the client's next request on it (see gateway/server.py).
    keep_alive_timeout: float = field(
        default=75.0,
        metadata={"help": "seconds a connection may sit idle between a response and the next request"},
    )
    header_timeout: float = field(
        default=10.0,
        metadata={
            "help": "seconds from connecting, or from a later request's first byte, to the end of its head (then 408)"
        },
    )
    max_header_bytes: int = field(
        default=64 << 10,
        metadata={"help": "largest request head accepted, request line and headers (bytes; then 431)"},
    )
    body_timeout: float = field(
        default=60.0,
        metadata={"help": "seconds to receive a whole request body once its head is in (a total; then 408)"},
    )
    log_level: LogLevel = field(default="info", metadata={"help": "the gateway's log level"})
    loop_profile: Path | None = field(
        default=None,
        metadata={
            "help": "diagnostics: sample what holds the event loop whenever it runs late, and write each place's "
            "share of the stalls (and the garbage collector's time) to this file on exit"
        },
    )
    # Set by code (tests give the supervised engine extra variables), never by a user.
    extra_env: dict[str, str] = field(default_factory=dict, metadata={"option": False})

    def check_server(self) -> None:
        if not self.host:
            raise ValueError("--host must not be empty")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be a port number (0-65535), got {self.port}")
        if self.db is not None:
            from store.db import check_url  # here: --help reads this module without SQLAlchemy

            check_url(self.db)
        _at_least(1, ("--max-body-bytes", self.max_body_bytes), ("--workers", self.workers))
        _at_least(1024, ("--max-header-bytes", self.max_header_bytes))
        _seconds(
            ("--store-wait", self.store_wait),
            ("--keep-alive-timeout", self.keep_alive_timeout),
            ("--header-timeout", self.header_timeout),
            ("--body-timeout", self.body_timeout),
        )
        _one_of("--log-level", self.log_level, LogLevel)


@dataclass(frozen=True)
class EngineSettings:
    """The vLLM engine the gateway supervises (or calls): its port, its arguments, its restarts, how long a
    call may take."""

    engine_port: int = field(
        default=0,
        metadata={
            "help": "port of the supervised vLLM server, the first's of --engines (the others on the ports after "
            "it; 0: free ports chosen at start)"
        },
    )
    engines: int = field(
        default=1,
        metadata={
            "help": "supervised vLLM engines of --base-model, each on a port of its own (--engine-port and the ones "
            "after it, or free ones), supervised and restarted each as one is (--engine-max-restarts counts each's "
            "own; logs DATA_DIR/engine.log, engine-1.log, ...), calls spread over them as over --upstream URLs; "
            "with GPUs each gets one (CUDA_VISIBLE_DEVICES; more engines than GPUs visible is refused), on CPU each "
            "a slice of the cores (OMP_NUM_THREADS, and VLLM_CPU_OMP_THREADS_BIND for vLLM's multiprocess executor), "
            "one core kept for the gateway when there are more cores than engines"
        },
    )
    # Set by code once the supervised engines' ports are chosen (free ones with --engine-port 0), never by a user.
    engine_ports: tuple[int, ...] = field(default=(), metadata={"option": False})
    engine_args: tuple[str, ...] = field(
        default=(), metadata={"help": "extra arguments for the supervised vLLM, one shell-quoted string"}
    )
    tool_call_parser: str = field(
        default="auto",
        metadata={
            "help": "vLLM's --tool-call-parser for the supervised engine; auto: the one the model's family speaks, "
            "read from its config.json and chat template (hermes, llama3_json, mistral; store/families.py)"
        },
    )
    reasoning_parser: str = field(
        default="auto",
        metadata={
            "help": "vLLM's --reasoning-parser for the supervised engine; auto: the model's family's (qwen3 for a "
            "Qwen3 template that thinks), none: no reasoning parser"
        },
    )
    max_lora_rank: int = field(default=16, metadata={"help": "vLLM's --max-lora-rank: the largest LoRA rank it loads"})
    max_loras: int = field(
        default=0,
        metadata={
            "help": "vLLM's --max-loras, adapters in one batch; more stay in memory (--max-cpu-loras: 3 per model) "
            "and any other loads on demand (0: 2 per model at start, at least 4)"
        },
    )
    max_model_len: int = field(default=4096, metadata={"help": "vLLM's --max-model-len"})
    engine_startup_timeout: float = field(default=600.0, metadata={"help": "seconds to wait for vLLM to start"})
    engine_max_restarts: int = field(
        default=3,
        metadata={
            "help": "restarts of a supervised vLLM that dies within --engine-restart-window seconds; one death more "
            "and the gateway exits non-zero (for its own supervisor to act). A death a request caused (its engine "
            "log has vLLM's dump of the step that raised) is restarted and not counted"
        },
    )
    engine_restart_window: float = field(
        default=600.0, metadata={"help": "seconds over which --engine-max-restarts counts the engine's restarts"}
    )
    request_timeout: float = field(default=600.0, metadata={"help": "seconds to wait for the engine's answer"})
    engine_saturation: int = field(
        default=256,
        metadata={
            "help": "with several engines: calls of this gateway in flight on an engine at which it is saturated; a "
            "rollout pinned to a saturated engine moves to the least loaded one"
        },
    )
    engine_health_interval: float = field(
        default=2.0,
        metadata={
            "help": "with several engines: seconds between two health probes of each (GET /health, and /v1/models "
            "for the LoRA steps it holds); one that fails its probe, or a call's connection, or lacks a served step, "
            "is out of rotation until its probe answers again and it holds every served step"
        },
    )

    def check_engine(self) -> None:
        if not 0 <= self.engine_port <= 65535:
            raise ValueError(f"--engine-port must be a port number (0-65535), got {self.engine_port}")
        _at_least(1, ("--engines", self.engines))
        if self.engine_port and self.engine_port + self.engines - 1 > 65535:
            raise ValueError(
                f"--engine-port {self.engine_port} with --engines {self.engines}: the engines' ports "
                f"{self.engine_port}-{self.engine_port + self.engines - 1} go past 65535"
            )
        _at_least(
            1,
            ("--max-lora-rank", self.max_lora_rank),
            ("--max-loras", self.max_loras + 1),  # 0 (auto) is fine
            ("--max-model-len", self.max_model_len),
            ("--engine-saturation", self.engine_saturation),
        )
        _at_least(0, ("--engine-max-restarts", self.engine_max_restarts))
        _seconds(
            ("--engine-startup-timeout", self.engine_startup_timeout),
            ("--engine-restart-window", self.engine_restart_window),
            ("--request-timeout", self.request_timeout),
            ("--engine-health-interval", self.engine_health_interval),
        )


@dataclass(frozen=True)
class AuthSettings:
    """Who may call: the admin key, client keys required or not, the metrics key."""

    admin_key: str | None = field(
        default=None,
        metadata={
            "help": "the admin key (all endpoints, admin ones included); better in the environment than on the "
            "command line (none: the one in --admin-key-file, made on first start)"
        },
    )
    admin_key_file: Path | None = field(
        default=None,
        metadata={"help": f"file holding the admin key, mode 0600 (none: DATA_DIR/{ADMIN_KEY_FILE})"},
    )
    auth: AuthMode | None = field(
        default=None,
        metadata={
            "help": "required: every call needs a key (POST /v1/art/keys); off: only admin endpoints do, allowed "
            "only when listening on loopback (none: off on loopback, required otherwise)"
        },
    )
    metrics_key: str | None = field(
        default=None,
        metadata={
            "help": "bearer key /metrics asks for (the admin key works too; none: the admin key only, or open "
            "with --auth off)"
        },
    )
    # With --auth off any web page could reach the gateway through a name it rebinds to 127.0.0.1: only these
    # `Host` (and `Origin`) names are answered (gateway/local_only.py).
    allowed_hosts: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "with --auth off, a Host name the gateway answers besides --host, localhost, 127.0.0.1 and "
            "[::1] (e.g. a name in /etc/hosts for this machine); repeat for several",
            "flag": "--allowed-host",
            "repeat": True,
        },
    )

    def check_auth(self) -> None:
        for flag, key in (("--admin-key", self.admin_key), ("--metrics-key", self.metrics_key)):
            if key is not None and len(key) < 16:
                raise ValueError(f"{flag} must be at least 16 characters")
        for name in self.allowed_hosts:
            if not HOST_NAME.fullmatch(name):
                raise ValueError(f"--allowed-host must be a host name (letters, digits, '.-'), got {name!r}")


@dataclass(frozen=True)
class RecordingSettings:
    """Recording each answered call exactly once (recording/): the queue, the journal, the store batches."""

    recorder_queue_size: int = field(
        default=10_000,
        metadata={"help": "records kept in memory for the store writer; past it they wait in the journal only"},
    )
    recorder_queue_bytes: int = field(
        default=64 << 20,
        metadata={"help": "bytes of records (journal size) kept in memory; past it they wait in the journal only"},
    )
    journal_fsync: FsyncPolicy = field(
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

    def check_recording(self) -> None:
        _at_least(
            1,
            ("--recorder-queue-size", self.recorder_queue_size),
            ("--recorder-queue-bytes", self.recorder_queue_bytes),
            ("--recorder-batch-size", self.recorder_batch_size),
            ("--recorder-cache-bytes", self.recorder_cache_bytes),
            ("--journal-segment-bytes", self.journal_segment_bytes),
        )
        _seconds(("--journal-fsync-interval", self.journal_fsync_interval))
        _one_of("--journal-fsync", self.journal_fsync, FsyncPolicy)


@dataclass(frozen=True)
class PromotionSettings:
    """Which committed step `NAME` serves (gateway/promotion/): the policy, the gate, the canary."""

    promotion: Promotion = field(
        default="always",
        metadata={
            "help": "always: `NAME` serves every committed step at once; gated: only a step that passes the "
            "model's eval sets against the promoted step (NAME@latest serves the newest either way)"
        },
    )
    gate_margin: float = field(
        default=0.05,
        metadata={
            "help": "a gated step passes when its eval reward is not below the promoted step's by more than "
            "this (mean per-scenario difference, judged by the lower end of its confidence interval)"
        },
    )
    gate_confidence: float = field(
        default=0.95, metadata={"help": "confidence of the gate's interval (Student t, paired by scenario)"}
    )
    canary: float = field(
        default=0.0,
        metadata={
            "help": "with --promotion gated: this share of the rollouts asking for NAME (by a hash of the rollout "
            "id) is served by a step that passed its eval sets, and live rewards decide its promotion; a promoted "
            "step whose live reward falls below the step before it by --gate-margin is rolled back (0: off)"
        },
    )
    canary_min_rewards: int = field(
        default=50, metadata={"help": "rewarded rollouts each canary arm needs before the canary is decided"}
    )
    eval_concurrency: int = field(
        default=8, metadata={"help": "eval scenarios answered at once while a step is evaluated"}
    )

    def check_promotion(self) -> None:
        _one_of("--promotion", self.promotion, Promotion)
        if not (math.isfinite(self.gate_margin) and 0 <= self.gate_margin <= 1):
            raise ValueError(f"--gate-margin must be between 0 and 1, got {self.gate_margin}")
        if not 0.5 <= self.gate_confidence < 1:
            raise ValueError(f"--gate-confidence must be at least 0.5 and below 1, got {self.gate_confidence}")
        if not (math.isfinite(self.canary) and 0 <= self.canary < 1):
            raise ValueError(f"--canary must be a share at least 0 and below 1, got {self.canary}")
        if self.canary > 0 and self.promotion != "gated":
            raise ValueError("--canary needs --promotion gated: with `always` every step is promoted at once")
        _at_least(2, ("--canary-min-rewards", self.canary_min_rewards))
        _at_least(1, ("--eval-concurrency", self.eval_concurrency))


@dataclass(frozen=True)
class JudgeSettings:
    """RULER's judges (gateway/groups/): which judges and webhook endpoints groups may use (the operator's
    choice, never a caller's), how many judge calls run at once, and the judge report's bar."""

    max_concurrent_judges: int = field(
        default=4,
        metadata={"help": "RULER judge calls running at once, every group's and judge's together (a panel's too)"},
    )
    judges_file: Path | None = field(
        default=None,
        metadata={
            "help": 'JSON file naming the RULER judges groups may use: {"NAME": {"model": "<litellm model>", '
            '"litellm_params": {api_base, api_key, extra_headers, ...}}}; a group picks them by NAME and may set only '
            "sampling parameters (none: RULER groups are refused; keep it 0600 if it holds keys)"
        },
    )
    group_webhooks: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "an endpoint (http(s)://host[:port][/path]) RULER groups' webhook checks may post to, at or under "
            "its path; repeat for several (none: webhook checks are refused)",
            "flag": "--group-webhook",
            "repeat": True,
        },
    )
    judge_agreement_threshold: float = field(
        default=0.5,
        metadata={
            "help": "a RULER rubric and judge whose mean per-group Spearman correlation with the callers' own "
            "rewards is below this is flagged (GET /v1/art/models/NAME/judge-report, -1 to 1)"
        },
    )

    def check_judges(self) -> None:
        from gateway.groups.policy import load_judges, webhook_endpoint_problem  # here: litellm loads slowly

        _at_least(1, ("--max-concurrent-judges", self.max_concurrent_judges))
        if self.judges_file is not None:
            load_judges(self.judges_file)
        for url in self.group_webhooks:
            problem = webhook_endpoint_problem(url)
            if problem is not None:
                raise ValueError(f"--group-webhook {url!r}: {problem}")
        if not -1.0 <= self.judge_agreement_threshold <= 1.0:  # written so NaN fails too
            raise ValueError(
                f"--judge-agreement-threshold must be a correlation (-1 to 1), got {self.judge_agreement_threshold}"
            )


# The sections' fields in this order: the models first, the judges last (a dataclass collects its bases' fields
# from the last base to the first).
@dataclass(frozen=True)
class Settings(
    JudgeSettings, PromotionSettings, RecordingSettings, AuthSettings, EngineSettings, ServerSettings, ModelSettings
):
    """Everything `artgw serve` is told, in sections; each option declared once, on its section."""

    def __post_init__(self) -> None:
        self.check_models()
        self.check_server()
        self.check_engine()
        self.check_auth()
        self.check_recording()
        self.check_promotion()
        self.check_judges()
        self.check_engines()
        if self.auth == "off" and self.host not in LOOPBACK_HOSTS:
            raise ValueError(
                f"--auth off is for a gateway on loopback only; it listens on {self.host!r} (use --auth required)"
            )

    def check_engines(self) -> None:
        """--engines starts supervised engines: with --base-model only, and no more than the machine has GPUs."""
        if self.engines == 1:
            return
        if self.upstream:
            raise ValueError(
                f"--engines {self.engines} starts supervised engines of --base-model; with --upstream, give each "
                "running engine's URL instead"
            )
        from engine.placement import this_machines_environments  # here: --help reads this module bare

        this_machines_environments(self.engines)

    @property
    def auth_required(self) -> bool:
        return self.auth == "required" or (self.auth is None and self.host not in LOOPBACK_HOSTS)

    @property
    def local_host_names(self) -> frozenset[str]:
        """The `Host` names a gateway with --auth off answers (lower case, no port, IPv6 without brackets)."""
        return frozenset(name.lower() for name in (self.host, *LOOPBACK_HOSTS, *self.allowed_hosts))

    @property
    def admin_key_path(self) -> Path:
        return self.admin_key_file or self.data_dir / ADMIN_KEY_FILE

    @property
    def sqlite_path(self) -> Path:
        """The default store's file (used unless --db names another store)."""
        return self.data_dir / "artgw.sqlite"

    @property
    def db_url(self) -> str:
        return self.db or f"sqlite+aiosqlite:///{self.sqlite_path.resolve()}"

    @property
    def supervised_ports(self) -> tuple[int, ...]:
        """The supervised engines' ports: as chosen at start, else --engine-port and the ones after it."""
        return self.engine_ports or tuple(self.engine_port + i for i in range(self.engines))

    @property
    def engine_urls(self) -> tuple[str, ...]:
        """The base URL of each engine the gateway sends calls to: the supervised ones, or each --upstream."""
        return self.upstream_urls or tuple(f"http://127.0.0.1:{port}" for port in self.supervised_ports)

    @property
    def upstream_url(self) -> str:
        """The first engine's: the one the control API (health, models, LoRA loading) talks to."""
        return self.engine_urls[0]
