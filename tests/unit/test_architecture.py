"""The rooms of the house: which package may import which, and no import cycles.

store/ (shared, no HTTP) ← recording/ (each call to the store exactly once) and engine/ (the vLLM supervisor, on
its own) ← gateway/ (HTTP); store/ ← client/ (the typed client of the gateway's /v1/art API, its only caller) ←
trainer/ (torch; of engine/ only the tool-call grammar vLLM samples under, which it rebuilds); ruler/ stands
alone; artgw/ (the CLI) sits on top. Checked on the source (every import statement, module level or not) and on
what a real `import trainer.train` loads. Inside gateway/, three rooms: its services, the HTTP layer over them,
and the app that builds and runs both (GATEWAY_HTTP, GATEWAY_TOP).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("artgw", "client", "engine", "gateway", "recording", "store", "trainer", "ruler", "migrations")

# What each package may import of the others (beside itself).
ALLOWED = {
    "store": set(),
    "ruler": set(),
    "client": {"store"},
    "trainer": {"store", "client", "engine"},
    "recording": {"store"},
    "engine": set(),
    "gateway": {"store", "ruler", "recording", "engine"},
    "migrations": {"store"},
    "artgw": {"gateway", "store", "trainer", "ruler", "client", "recording", "engine"},
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {
        _module_name(path): path
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if "versions" not in path.parts  # migration scripts are loaded by Alembic, not imported
    }


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules `name` imports (a package's `__init__` counts for every module under it)."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], base]).strip(".")
            targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        for target in targets:
            parts = target.split(".")
            for i in range(1, len(parts) + 1):  # importing a.b.c runs a and a.b too
                candidate = ".".join(parts[:i])
                if candidate in known and candidate != name:
                    found.add(candidate)
    return found


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def test_each_package_imports_only_the_rooms_below_it() -> None:
    wrong = sorted(
        f"{name} imports {target}"
        for name, targets in _graph().items()
        for target in targets
        if (a := name.split(".")[0]) != (b := target.split(".")[0]) and b not in ALLOWED[a]
    )
    assert wrong == []


def test_no_import_cycles() -> None:
    graph = _graph()
    # A package importing its own submodules from its __init__ is not a cycle of concern: drop those edges.
    for name, targets in graph.items():
        graph[name] = {t for t in targets if not t.startswith(name + ".")}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == []


# ---------------------------------------------------------------- gateway/'s own rooms (#44)

# Bottom to top: the services (every module not named below: the APIs' schemas, translations and services, the
# engine call, the stores' services), then the HTTP layer that reads them (handlers, guards, the OpenAPI
# document, the web UI, and `services.py`, the one object handlers find them in), then what builds and runs the
# app. A module imports its own room's modules and those of the rooms below it.
GATEWAY_HTTP = ("gateway.apis.routes", "gateway.art_api", "gateway.guards", "gateway.openapi", "gateway.local_only")
GATEWAY_HTTP += ("gateway.services", "gateway.ui")
GATEWAY_TOP = ("gateway.app", "gateway.provide", "gateway.server")


def gateway_room(module: str) -> int:
    """0: a service; 1: the HTTP layer; 2: the app, its building (provide.py) and its server."""
    if any(module == m or module.startswith(m + ".") for m in GATEWAY_TOP):
        return 2
    return 1 if any(module == m or module.startswith(m + ".") for m in GATEWAY_HTTP) else 0


def test_gateway_imports_only_its_own_room_and_those_below() -> None:
    """Services never import the HTTP layer, and handlers never import what builds the services (provide.py):
    they read them from `gateway.services`. The knots this unties: `apis/routes.py` and `guards.py` importing
    provide.py for `services_of`."""
    wrong = sorted(
        f"{name} imports {target}"
        for name, targets in _graph().items()
        if name.startswith("gateway.")
        for target in targets
        if target.startswith("gateway.") and gateway_room(target) > gateway_room(name)
    )
    assert wrong == []


def test_only_the_http_layer_and_the_wire_errors_import_litestar() -> None:
    """The services are Litestar-free: what answers HTTP is the HTTP layer's, bar the wire errors
    (gateway/errors.py), which build their own responses."""
    found = []
    for name, path in _modules().items():
        if name.startswith("gateway") and gateway_room(name) == 0 and name != "gateway.errors":
            for node in ast.walk(ast.parse(path.read_text())):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
                found += [f"{name}: {n}" for n in names if n.split(".")[0] == "litestar"]
    assert found == []


def test_the_engine_call_path_knows_no_api_and_the_openapi_document_no_engine_call() -> None:
    """gateway/proxy.py and continuation.py serve the four APIs alike, so they import none of them; the OpenAPI
    document describes the wire and imports nothing of the engine call (it once imported proxy.py for a header
    name)."""
    graph = _graph()
    engine_path = ("gateway.proxy", "gateway.continuation", "gateway.asgi")
    assert sorted(t for m in engine_path for t in graph[m] if t.startswith("gateway.apis")) == []
    assert sorted(graph["gateway.openapi"] & set(engine_path)) == []


def test_the_services_are_built_whole() -> None:
    """provide.py hands each service what it needs when it builds it: no attribute of a built service is set
    afterwards (the promotion gate learned of commits through `adapters.on_commit = promotions.step_committed`;
    the commit now goes through PromotionService.commit)."""
    tree = ast.parse((ROOT / "gateway" / "provide.py").read_text())
    build = next(n for n in ast.walk(tree) if isinstance(n, ast.AsyncFunctionDef) and n.name == "provide_services")
    set_after = [
        ast.unparse(target)
        for node in ast.walk(build)
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign)
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Attribute)
    ]
    assert set_after == []


@pytest.mark.parametrize(
    ("module", "forbidden"),
    [
        ("trainer.train", {"gateway", "litestar", "artgw"}),
        ("client", {"gateway", "litestar", "trainer", "torch", "artgw"}),
        ("store.provide", {"gateway", "litestar", "trainer", "torch", "artgw"}),
        ("recording.recorder", {"gateway", "litestar", "trainer", "torch", "artgw"}),
        ("engine.supervisor", {"gateway", "litestar", "store", "trainer", "torch", "artgw"}),
        ("ruler", {"gateway", "store", "trainer", "litestar"}),
        # Every `artgw` command loads the CLI (its parser is built from every command's settings): what only one
        # command needs (the store's SQLAlchemy and Alembic, the demo's client, the server, torch) is imported by that
        # command, not by `artgw keys --help` (~0.15 s of CPU a command, not ~0.7).
        ("artgw.cli", {"sqlalchemy", "alembic", "litestar", "uvicorn", "httpx", "client", "torch", "transformers"}),
    ],
)
def test_importing_a_room_loads_nothing_above_it(module: str, forbidden: set[str]) -> None:
    code = f"import {module}, sys; print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(forbidden)!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"


def test_no_test_module_imports_another() -> None:
    """Shared fixtures and builders live in tests/conftest.py or small helper modules (tests/*.py), never in a
    test module another one imports (importing it would collect its tests twice over and tie the two together)."""
    offenders = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            offenders += [f"{path.relative_to(ROOT)}: {name}" for name in names if ".test_" in f".{name}"]
    assert offenders == []


def test_no_caller_has_a_default() -> None:
    """Deny by default (#26): every function of the gateway that reads or changes data for someone takes that
    someone (`caller`) as a required argument, so a call site that forgets it fails instead of seeing every
    model. Checked on the source: a `caller` parameter with a default value anywhere in gateway/."""
    defaulted = []
    for name, path in _modules().items():
        if not name.startswith("gateway"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                continue
            if isinstance(node, ast.ClassDef):  # a dataclass field `caller: Caller = ...`
                fields = [s for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)]
                defaulted += [f"{name}.{node.name}" for s in fields if s.target.id == "caller" and s.value]
                continue
            args = node.args
            positional = [*args.posonlyargs, *args.args]
            with_defaults = positional[len(positional) - len(args.defaults) :]
            kw_defaulted = [a for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d is not None]
            if any(a.arg == "caller" for a in [*with_defaults, *kw_defaulted]):
                defaulted.append(f"{name}.{node.name}")
    assert defaulted == []


def test_the_inference_apis_side_by_side() -> None:
    """The four inference APIs in one shape (#26): gateway/apis/<api>/ with its request's `schema`, its
    `translate` to and from the engine's form, and its `service` over the one engine-call path (gateway/proxy.py);
    no API module left beside them but the routes."""
    apis = ROOT / "gateway" / "apis"
    shapes = {
        p.name: sorted(f.name for f in p.glob("*.py")) for p in apis.iterdir() if p.is_dir() and p.name != "__pycache__"
    }
    assert shapes == {
        api: ["__init__.py", "schema.py", "service.py", "translate.py"]
        for api in ("chat", "completions", "messages", "responses")
    }
    assert sorted(p.name for p in apis.glob("*.py")) == ["__init__.py", "routes.py"]


# ---------------------------------------------------------------- one client of the /v1/art API (#26)

# The HTTP libraries a module could call the gateway with.
HTTP_LIBRARIES = {"httpx", "requests", "aiohttp", "urllib.request", "http.client", "urllib3"}
# The modules of artgw/ and trainer/ that may import one, and why: neither for the /v1/art API.
HTTP_ALLOWED = {
    "artgw.cli": "names httpx's transport errors, to word a gateway that does not answer as one line",
    "artgw.demo": "polls the gateway's and the trainer's /readyz until they are up",
}


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring nodes of a module, its classes and functions: documentation, never a URL."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def art_urls(source: str) -> list[str]:
    """The strings of `source` that build a path or URL of the gateway's /v1/art API: `/v1/art` at the start of a
    string or of an f-string's literal part (`f"{url}/v1/art/keys"`), or after anything but whitespace
    (`"http://host/v1/art"`). Prose names an endpoint after a space (`"what GET /v1/art/models/NAME says"`, an
    option's help, an error message) and is not one; docstrings are documentation and are not read."""
    tree = ast.parse(source)
    skip = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            text = node.value
            at = text.find("/v1/art")
            while at != -1:
                if at == 0 or not text[at - 1].isspace():
                    found.append(text)
                    break
                at = text.find("/v1/art", at + 1)
    return found


@pytest.mark.parametrize(
    ("source", "builds"),
    [
        ('httpx.get(f"{url}/v1/art/groups/{g}")', True),
        ('client.request("DELETE", "/v1/art/keys/" + key)', True),
        ('URL = "http://127.0.0.1:8000/v1/art/models"', True),
        ('path = f"/v1/art/models/{name}"', True),
        ('help = "print what GET /v1/art/models/NAME says"', False),
        ('raise Error(f"POST /v1/art/keys answered {status}")', False),
        ('def f():\n    """Reads `/v1/art/groups`."""', False),
    ],
)
def test_the_check_for_art_urls_tells_a_url_from_prose(source: str, builds: bool) -> None:
    assert bool(art_urls(source)) is builds


def test_only_the_client_calls_the_art_api() -> None:
    """One client (#26): client/art.py's ArtClient is the only code that speaks the gateway's /v1/art API. No module
    of the CLI (artgw/) or the trainer builds a /v1/art path or URL (art_urls says how one is told from prose), and
    only the modules in HTTP_ALLOWED import an HTTP library, for what it names there. (The demo's agent calls the
    OpenAI-compatible /v1 API through the OpenAI SDK: that is the app's, not the art API.)"""
    builders, importers = [], set()
    for name, path in _modules().items():
        if name.split(".")[0] not in ("artgw", "trainer"):
            continue
        builders += [f"{name}: {text!r}" for text in art_urls(path.read_text())]
        for node in ast.walk(ast.parse(path.read_text())):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):  # `from urllib import request` too
                names += [node.module or "", *(f"{node.module}.{alias.name}" for alias in node.names)]
            if any(n in HTTP_LIBRARIES or n.split(".")[0] in HTTP_LIBRARIES for n in names):
                importers.add(name)
    assert builders == []
    assert importers <= set(HTTP_ALLOWED), sorted(importers - set(HTTP_ALLOWED))
    # The client does build them: the check reads the right files.
    assert art_urls((ROOT / "client" / "art.py").read_text())
