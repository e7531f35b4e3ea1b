"""Where RULER may send: the judges and webhook endpoints the operator allows, and nothing a caller names.

A judge is a litellm call, and litellm adds the gateway's own provider key (`OPENAI_API_KEY`, ...) to it; a
check's webhook is a POST from inside the deployment. So neither goes where a `reward` key says (#40). The
operator names each judge in `--judges-file` (a name → a litellm model and its parameters: endpoint, key,
headers); a group picks judges by those names and may add only sampling parameters (`CALLER_PARAMS`). Group
checks' webhooks post only under an endpoint given with `--group-webhook`. A caller learns the names it may
use, never what stands behind them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import httpx
import msgspec

import ruler
from store.api import RulerIn

# What a caller may still choose of a judge's call, and the JSON type each takes: how it samples and how long it
# may answer. Everything else (api_base, api_key, extra_headers, base_url, custom_llm_provider, ...) is the
# operator's, deny by default.
_CALLER_TYPES: dict[str, type | tuple[type, ...]] = {
    "temperature": (int, float),
    "top_p": (int, float),
    "max_tokens": int,
    "max_completion_tokens": int,
    "seed": int,
}
CALLER_PARAMS = frozenset(_CALLER_TYPES)
_CALLER_CHOICES = ", ".join(sorted(CALLER_PARAMS))
JUDGE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@-]{0,255}")
_RESERVED = frozenset({"model", "messages", "response_format", "stream"})  # ruler.score_group sets these
_DEFAULT_PORTS = {"http": 80, "https": 443}


class OperatorJudge(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One judge of `--judges-file`: litellm's model name and the parameters its calls get (the operator's:
    api_base, api_key, extra_headers, ...; a caller's sampling parameters override only CALLER_PARAMS)."""

    model: Annotated[str, msgspec.Meta(min_length=1)]
    litellm_params: dict[str, Any] = {}


class Refused(Exception):
    """A group's `ruler` asks for what the operator does not allow: `field` under `ruler.` names where."""

    def __init__(self, message: str, *, field: str, code: str) -> None:
        super().__init__(message)
        self.message, self.field, self.code = message, field, code


def load_judges(path: Path) -> dict[str, OperatorJudge]:
    """`--judges-file`: a JSON object `{"NAME": {"model": "openai/gpt-4o-mini", "litellm_params": {...}}}`;
    ValueError naming the option for a file that cannot be used (litellm must know each model)."""
    where = f"--judges-file {path}"
    try:
        judges = msgspec.json.decode(path.read_bytes(), type=dict[str, OperatorJudge])
    except OSError as exc:
        raise ValueError(f"{where}: {exc.strerror or exc}") from None
    except msgspec.DecodeError as exc:
        raise ValueError(
            f'{where}: {exc} (expected {{"NAME": {{"model": "<litellm model>", "litellm_params": {{...}}}}}})'
        ) from None
    for name, judge in judges.items():
        if not JUDGE_NAME.fullmatch(name):
            raise ValueError(f"{where}: judge name {name!r}: 1 to 256 letters, digits and `._:/@-`")
        reserved = sorted(_RESERVED & judge.litellm_params.keys())
        if reserved:
            raise ValueError(f"{where}: judge {name!r} sets {', '.join(reserved)}: RULER sets them")
        try:
            ruler.check_judge_model(judge.model, judge.litellm_params)
        except ruler.RulerError as exc:
            raise ValueError(f"{where}: judge {name!r}: {exc}") from None
    return judges


def webhook_endpoint_problem(url: str) -> str | None:
    """Why `url` cannot be an allowed webhook endpoint (`--group-webhook`), or None."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        return f"not a URL ({exc})"
    if parsed.userinfo or parsed.query or parsed.fragment:
        return "has user info, a query or a fragment (an endpoint is a scheme, host, port and path)"
    if not parsed.host or _where(url) is None:
        return "not an http:// or https:// URL with a host and a path without `.` or `..`"
    return None


def _where(url: str) -> tuple[str, str, int, tuple[str, ...]] | None:
    """(scheme, host, port, path segments) as httpx will send it; None if the path steps up (`..`, encoded or
    not): it must stay under an allowed path whatever the server makes of it."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL:
        return None
    segments = tuple(s for s in parsed.path.split("/") if s)
    if any(s in (".", "..") for s in segments) or parsed.scheme not in _DEFAULT_PORTS:
        return None
    return parsed.scheme, parsed.host.lower(), parsed.port or _DEFAULT_PORTS[parsed.scheme], segments


class RulerPolicy:
    """The operator's judges and webhook endpoints; one, built from the settings, shared by the group service
    (refuses at the POST) and the scorer (refuses again when a stored group is judged after a restart)."""

    def __init__(self, judges: Mapping[str, OperatorJudge], webhooks: tuple[str, ...]) -> None:
        self.judges = dict(judges)
        self._webhooks = [w for w in map(_where, webhooks) if w is not None]

    def panel(self, spec: RulerIn) -> list[ruler.Judge]:
        """The judges a group's `ruler` names, as litellm calls them; Refused for a name or a parameter the
        operator did not allow."""
        if spec.judges:
            named = [(f"judges[{i}].", j.judge_model, j.litellm_params) for i, j in enumerate(spec.judges)]
        elif spec.judge_model is not None:
            named = [("", spec.judge_model, spec.litellm_params)]
        else:
            raise Refused(
                "Name the judge with `judge_model`, or a panel with `judges`.",
                field="judge_model",
                code="invalid_judges",
            )
        return [self._judge(prefix, name, params) for prefix, name, params in named]

    def _judge(self, prefix: str, name: str, params: Mapping[str, Any]) -> ruler.Judge:
        judge = self.judges.get(name)
        if judge is None:
            known = ", ".join(f"`{n}`" for n in sorted(self.judges)) or "none"
            raise Refused(
                f"Unknown judge `{name}`: name one of this gateway's judges ({known}); its operator lists them "
                "in --judges-file.",
                field=f"{prefix}judge_model",
                code="unknown_judge",
            )
        for key, value in sorted(params.items()):
            if key not in CALLER_PARAMS:
                raise Refused(
                    f"`litellm_params.{key}` is not a judge parameter a group may set: a judge's endpoint, keys "
                    f"and headers are its operator's (--judges-file). A group may set {_CALLER_CHOICES}.",
                    field=f"{prefix}litellm_params.{key}",
                    code="judge_param_not_allowed",
                )
            if isinstance(value, bool) or not isinstance(value, _CALLER_TYPES[key]):
                kind = "an integer" if _CALLER_TYPES[key] is int else "a number"
                raise Refused(
                    f"`litellm_params.{key}` must be {kind}, got {type(value).__name__}.",
                    field=f"{prefix}litellm_params.{key}",
                    code="invalid_value",
                )
        # Precedence: the caller's sampling choice, then the operator's parameters, then litellm's defaults.
        return ruler.Judge(judge.model, {**judge.litellm_params, **params})

    def allows_webhook(self, url: str) -> bool:
        """Whether a check may POST to `url`: the same scheme, host and port as an allowed endpoint, and its
        path at or under that endpoint's (whole segments: `/hook` does not allow `/hooks`)."""
        where = _where(url)
        return where is not None and any(
            where[:3] == allowed[:3] and where[3][: len(allowed[3])] == allowed[3] for allowed in self._webhooks
        )
