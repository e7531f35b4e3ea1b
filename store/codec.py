"""The compact form of a recorded call: what a `calls` row holds, and how a rollout's rows become records again.

An agent re-sends its whole growing conversation on every call, so storing each call whole costs O(N²) for a
rollout of N calls. Here a call is stored against an earlier call of its rollout, its *base*:

- prompt token ids: the longest common prefix with the base's prompt followed by one of the base's
  completions (`prompt_base_choice`; NULL: the base's prompt alone) is a length, `prompt_prefix_len`; only
  the rest, `prompt_suffix`, is stored;
- the request's messages: the same against the base's messages followed by one of its choices' messages;
- the request without its messages: NULL when it equals the base's;
- sampled token ids and logprobs: binary (`completion_ids`, `completion_logprobs`, all choices concatenated;
  `choices` keeps each choice's message, finish reason and counts).

Binary lists carry a format byte: token ids are int32 little-endian (a 150k vocabulary needs more than 16
bits), int64 or JSON when an id does not fit; logprobs are float32 when every value survives the round trip
(vLLM's are float32 values carried in doubles), float64 otherwise. Empty lists are empty blobs.

A base is always a call of the same rollout committed in the same or an earlier transaction, so a rollout's
rows resolve among themselves (`expand`), and every base is strictly older in the writer's order: no cycles.
Deleting a call would need the calls stored against it expanded first (nothing deletes calls today).

Messages and requests are compared by their JSON encodings, not by `==`: `1 == 1.0 == True` in Python, and a
shared prefix must give back the very JSON that was sent.
"""

from __future__ import annotations

import sys
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgspec

from store.records import CallRecord, ChoiceRecord, RolloutKey

# Format bytes: the first byte of a non-empty blob.
IDS_INT32 = 1
IDS_INT64 = 2
IDS_JSON = 3  # ids beyond int64: never from a tokenizer, but a record must always round-trip
FLOATS_F32 = 1
FLOATS_F64 = 2

_LITTLE = sys.byteorder == "little"
assert array("i").itemsize == 4 and array("q").itemsize == 8 and array("f").itemsize == 4

_encode_json = msgspec.json.Encoder().encode


class CorruptRollout(RuntimeError):
    """A row refers to a base call its rollout does not have (or the references loop): never written so."""


# --- binary lists ------------------------------------------------------------------------------------


def _pack(typecode: str, values: Iterable[Any]) -> bytes:
    packed = array(typecode, values)
    if not _LITTLE:
        packed.byteswap()
    return packed.tobytes()


def _unpack(typecode: str, data: bytes | memoryview) -> list[Any]:
    unpacked = array(typecode)
    unpacked.frombytes(data)
    if not _LITTLE:
        unpacked.byteswap()
    return unpacked.tolist()


def pack_int32(ids: Sequence[int]) -> bytes | None:
    """The ids as int32 little-endian, no format byte; None when one does not fit."""
    try:
        return _pack("i", ids)
    except (OverflowError, TypeError):
        return None


def encode_ids(ids: Sequence[int]) -> bytes:
    """Token ids as a blob: a format byte, then int32 (int64, JSON) little-endian values; b"" for []."""
    if not ids:
        return b""
    packed = pack_int32(ids)
    if packed is not None:
        return bytes([IDS_INT32]) + packed
    try:
        return bytes([IDS_INT64]) + _pack("q", ids)
    except (OverflowError, TypeError):
        return bytes([IDS_JSON]) + _encode_json(list(ids))


def decode_ids(blob: bytes | memoryview | None) -> list[int]:
    if not blob:
        return []
    view = memoryview(blob)
    if view[0] == IDS_INT32:
        return _unpack("i", view[1:])
    if view[0] == IDS_INT64:
        return _unpack("q", view[1:])
    if view[0] == IDS_JSON:
        return msgspec.json.decode(view[1:], type=list[int])
    raise CorruptRollout(f"unknown token id format {view[0]}")


def encode_floats(values: Sequence[float]) -> bytes:
    """Logprobs as a blob: float32 when that loses nothing (vLLM's), else float64; b"" for []."""
    if not values:
        return b""
    try:
        single = array("f", values)
    except OverflowError:
        single = None
    if single is not None and single.tolist() == list(values):  # NaN never equals itself: float64 keeps it
        if not _LITTLE:
            single.byteswap()
        return bytes([FLOATS_F32]) + single.tobytes()
    return bytes([FLOATS_F64]) + _pack("d", values)


def decode_floats(blob: bytes | memoryview | None) -> list[float]:
    if not blob:
        return []
    view = memoryview(blob)
    if view[0] == FLOATS_F32:
        return _unpack("f", view[1:])
    if view[0] == FLOATS_F64:
        return _unpack("d", view[1:])
    raise CorruptRollout(f"unknown logprob format {view[0]}")


# --- common prefixes ---------------------------------------------------------------------------------


def common_prefix_int32(a: bytes, b: bytes) -> int:
    """How many leading int32 values two packed sequences share."""
    n = min(len(a), len(b)) // 4
    if a[: 4 * n] == b[: 4 * n]:  # the usual case, an extension: one memcmp
        return n
    lo, hi = 0, n  # invariant: the first lo values are equal, the first hi are not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[4 * lo : 4 * mid] == b[4 * lo : 4 * mid]:  # only the untested middle: O(n) bytes compared in all
            lo = mid
        else:
            hi = mid
    return lo


def common_prefix(a: Sequence[bytes], b: Sequence[bytes]) -> int:
    """How many leading items two lists share."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    return next(i for i in range(n) if a[i] != b[i])


# --- writing -----------------------------------------------------------------------------------------


class Head(msgspec.Struct, frozen=True):
    """What later calls of a rollout are compacted against: one recorded call, in comparable form."""

    call_id: str
    prompt: bytes | None  # int32 prompt ids, no format byte; None: an id beyond int32 (then never a base)
    completions: list[bytes | None]  # each choice's sampled ids, int32
    messages: list[bytes] | None  # the request's messages, each JSON-encoded; None: no messages list
    replies: list[bytes]  # each choice's message, JSON-encoded
    rest: bytes  # the request without its messages, JSON-encoded
    size: int  # bytes held, for the cache's budget


def _prompt_prefix(prompt: bytes | None, head: Head) -> tuple[int | None, int]:
    """(choice, length): the longest prefix `prompt` shares with the head's prompt (+ one completion)."""
    if prompt is None or head.prompt is None:
        return None, 0
    shared = common_prefix_int32(prompt, head.prompt)
    if 4 * shared < len(head.prompt):
        return None, shared
    best_choice, best = None, shared
    rest = prompt[len(head.prompt) :]
    for choice, completion in enumerate(head.completions):
        if completion is not None and (more := common_prefix_int32(rest, completion)) and shared + more > best:
            best_choice, best = choice, shared + more
    return best_choice, best


def _messages_prefix(messages: list[bytes] | None, head: Head) -> tuple[int | None, int]:
    """(choice, length): the longest prefix `messages` shares with the head's messages (+ one reply)."""
    if messages is None or head.messages is None:
        return None, 0
    shared = common_prefix(messages, head.messages)
    if shared < len(head.messages) or len(messages) == shared:
        return None, shared
    following = messages[shared]
    choice = next((i for i, reply in enumerate(head.replies) if reply == following), None)
    return choice, shared + (choice is not None)


def compact(record: CallRecord, heads: Sequence[Head]) -> tuple[dict[str, Any], Head]:
    """The `calls` row of a record, stored against the best of `heads` (earlier calls of its rollout), and
    the record's own head for the calls after it."""
    prompt = pack_int32(record.prompt_token_ids)
    completions = [pack_int32(c.token_ids) for c in record.choices]
    raw_messages = record.request.get("messages")
    has_messages = isinstance(raw_messages, list)
    if has_messages:
        # The messages' key stays, as a null placeholder: the request comes back with its keys in their order.
        rest_dict = {k: None if k == "messages" else v for k, v in record.request.items()}
        # has_messages: a list (mypy does not narrow raw_messages through the flag).
        messages: list[bytes] | None = [_encode_json(m) for m in raw_messages]  # type: ignore[union-attr]
    else:
        rest_dict, messages = record.request, None
    rest = _encode_json(rest_dict)

    base: Head | None = None
    best = (0, 0, False)
    whole = (len(prompt or b"") // 4, len(messages or ()), True)
    choices: tuple[int | None, int | None] = (None, None)
    for head in reversed(heads):  # the newest wins a tie
        prompt_choice, prompt_len = _prompt_prefix(prompt, head)
        messages_choice, messages_len = _messages_prefix(messages, head)
        score = (prompt_len, messages_len, rest == head.rest)
        if score > best:
            base, best, choices = head, score, (prompt_choice, messages_choice)
            if score == whole:  # nothing left to store: no older head can do better
                break
    prompt_len, messages_len, same_rest = best

    if prompt is not None:
        suffix = prompt[4 * prompt_len :]
        prompt_suffix = bytes([IDS_INT32]) + suffix if suffix else b""
    else:
        prompt_suffix = encode_ids(record.prompt_token_ids)
    packed = [c for c in completions if c is not None]
    if len(packed) == len(completions):  # already int32: just concatenated
        completion_ids = bytes([IDS_INT32]) + b"".join(packed) if any(packed) else b""
    else:
        completion_ids = encode_ids([t for c in record.choices for t in c.token_ids])
    row: dict[str, Any] = {
        "id": record.call_id,
        "rollout_owner": record.rollout_key.owner,
        "rollout_id": record.rollout_id,
        "model": record.model,
        "step": record.step,
        "upstream_model": record.upstream_model,
        "stream": record.stream,
        "api": record.api,
        "key_id": record.key_id,
        "rollout_known": record.rollout_known,
        "engine": record.engine,
        "continued": record.continued,
        "status": record.status,
        "http_status": record.http_status,
        "error": record.error,
        "base_call_id": base.call_id if base is not None else None,
        "request": None if same_rest else rest_dict,
        "messages_base_choice": choices[1],
        "messages_prefix_len": messages_len if has_messages else None,
        # has_messages: a list (mypy does not narrow raw_messages through the flag).
        "messages_suffix": raw_messages[messages_len:] if has_messages else None,  # type: ignore[index]
        "prompt_base_choice": choices[0],
        "prompt_prefix_len": prompt_len,
        "prompt_suffix": prompt_suffix,
        "choices": [
            {
                "index": c.index,
                "message": c.message,
                "finish_reason": c.finish_reason,
                "tokens": len(c.token_ids),
                "logprobs": len(c.logprobs),
            }
            for c in record.choices
        ],
        "completion_ids": completion_ids,
        "completion_logprobs": encode_floats([lp for c in record.choices for lp in c.logprobs]),
        "usage": record.usage,
        "started_at": record.started_at,
        "first_token_at": record.first_token_at,
        "ended_at": record.ended_at,
    }
    replies = [_encode_json(c.message) for c in record.choices]
    size = len(prompt or b"") + sum(len(c or b"") for c in completions) + len(rest) + sum(map(len, replies))
    size += sum(map(len, messages or ())) + 200  # + the objects' own overhead, roughly
    head = Head(record.call_id, prompt, completions, messages, replies, rest, size)
    return row, head


class CallCache:
    """The last few recorded calls of recently active rollouts: the bases of their next calls.

    Bounded by total bytes and by rollouts, least recently used first out. Only calls whose transaction has
    committed are in it (`write_calls_sync` stages a batch's heads, `committed` adds them), so a base is
    always in the store. A miss (a restart, another replica wrote the previous call, an eviction) only means
    the next call is stored whole. Not thread-safe: one writer at a time (the recorder has one).
    """

    def __init__(self, max_bytes: int = 64 << 20, max_rollouts: int = 100_000, per_rollout: int = 4) -> None:
        self.max_bytes = max_bytes
        self.max_rollouts = max_rollouts
        # Several per rollout: interleaved sub-agents, or n > 1 branches, each find their own last call.
        self.per_rollout = per_rollout
        self.size = 0
        self._heads: OrderedDict[RolloutKey, list[Head]] = OrderedDict()
        self._staged: dict[RolloutKey, list[Head]] = {}

    def __len__(self) -> int:
        return len(self._heads)

    def heads(self, rollout: RolloutKey) -> list[Head]:
        return self._heads.get(rollout, [])

    def stage(self, heads: dict[RolloutKey, list[Head]]) -> None:
        """The heads of a batch being written: they count once `committed` is called."""
        self._staged = heads

    def discard(self) -> None:
        self._staged = {}

    def committed(self) -> None:
        """The transaction of the last staged batch committed: its calls may now be bases."""
        staged, self._staged = self._staged, {}
        for rollout, heads in staged.items():
            old = self._heads.pop(rollout, [])
            self.size -= sum(h.size for h in old)
            heads = heads[-self.per_rollout :]
            size = sum(h.size for h in heads)
            if size > self.max_bytes:  # larger than the whole budget: never cached
                continue
            self._heads[rollout] = heads
            self.size += size
        while self._heads and (self.size > self.max_bytes or len(self._heads) > self.max_rollouts):
            _, evicted = self._heads.popitem(last=False)
            self.size -= sum(h.size for h in evicted)


# --- reading -----------------------------------------------------------------------------------------


class _Full(msgspec.Struct):
    """One call resolved: what its successors' prefixes are taken from."""

    prompt: list[int]
    completions: list[list[int]]
    messages: list[Any] | None
    replies: list[Any]
    rest: dict[str, Any]


def _resolve(row: Mapping[str, Any], base: _Full | None) -> tuple[_Full, list[ChoiceRecord]]:
    prompt_len = row["prompt_prefix_len"] or 0
    messages_len = row["messages_prefix_len"] or 0
    if base is None and (prompt_len or messages_len or row["request"] is None):
        raise CorruptRollout(f"call {row['id']} is stored against a call it has no reference to")
    prompt = decode_ids(row["prompt_suffix"])
    if prompt_len:
        assert base is not None
        choice = row["prompt_base_choice"]
        shared = base.prompt if choice is None else base.prompt + base.completions[choice]
        prompt = shared[:prompt_len] + prompt
    messages = row["messages_suffix"]
    if messages is not None and messages_len:
        assert base is not None and base.messages is not None
        choice = row["messages_base_choice"]
        shared = base.messages if choice is None else [*base.messages, base.replies[choice]]
        messages = shared[:messages_len] + messages
    rest = row["request"]
    if rest is None:
        assert base is not None
        rest = base.rest
    ids = decode_ids(row["completion_ids"])
    logprobs = decode_floats(row["completion_logprobs"])
    choices: list[ChoiceRecord] = []
    at_id = at_lp = 0
    for c in row["choices"]:
        n, m = c["tokens"], c["logprobs"]
        choices.append(
            ChoiceRecord(
                c["index"], c["message"], c["finish_reason"], ids[at_id : at_id + n], logprobs[at_lp : at_lp + m]
            )
        )
        at_id += n
        at_lp += m
    full = _Full(prompt, [c.token_ids for c in choices], messages, [c.message for c in choices], rest)
    return full, choices


def expand(rows: Sequence[Mapping[str, Any]], explicit: bool) -> list[CallRecord]:
    """The records of one rollout's rows (all of them: bases are looked up among them), in the rows' order.

    Message dicts and request values are shared between the records of a prefix (read-only by convention).
    """
    by_id = {row["id"]: row for row in rows}
    resolved: dict[str, tuple[_Full, list[ChoiceRecord]]] = {}
    for row in rows:
        # Walk down to a resolved (or whole) call, then resolve back up: a loop, not a recursion, so a chain
        # of thousands of calls is fine.
        chain = [row]
        while (base_id := chain[-1]["base_call_id"]) is not None and base_id not in resolved:
            if base_id not in by_id:
                raise CorruptRollout(f"call {chain[-1]['id']} is stored against {base_id}, not found in its rollout")
            if len(chain) > len(by_id):
                raise CorruptRollout(f"the calls of rollout {row['rollout_id']} refer to each other in a loop")
            chain.append(by_id[base_id])
        for link in reversed(chain):
            if link["id"] not in resolved:
                base_id = link["base_call_id"]
                resolved[link["id"]] = _resolve(link, resolved[base_id][0] if base_id is not None else None)
    records = []
    for row in rows:
        full, choices = resolved[row["id"]]
        # A dict of its own per record (a request stored as NULL is its base's); the messages go back in the
        # place their key kept.
        request = dict(full.rest) if full.messages is None else {**full.rest, "messages": full.messages}
        records.append(
            CallRecord(
                call_id=row["id"],
                rollout_id=row["rollout_id"],
                rollout_explicit=explicit,
                model=row["model"],
                step=row["step"],
                upstream_model=row["upstream_model"],
                request=request,
                stream=bool(row["stream"]),
                status=row["status"],
                http_status=row["http_status"],
                error=row["error"],
                prompt_token_ids=full.prompt,
                choices=choices,
                usage=row["usage"],
                started_at=row["started_at"],
                first_token_at=row["first_token_at"],
                ended_at=row["ended_at"],
                api=row.get("api") or "chat",
                key_id=row.get("key_id"),
                rollout_known=row.get("rollout_known"),
                engine=row.get("engine"),
                continued=row.get("continued"),
            )
        )
    return records
