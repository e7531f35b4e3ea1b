"""The compact call format (store/codec.py) without a database: binary lists, compaction, expansion, the cache."""

from __future__ import annotations

import math
import random
import sys
from array import array
from typing import Any

import msgspec
import pytest

from store.codec import (
    FLOATS_F32,
    FLOATS_F64,
    IDS_INT32,
    IDS_INT64,
    IDS_JSON,
    CallCache,
    CorruptRollout,
    Head,
    common_prefix,
    common_prefix_int32,
    compact,
    decode_floats,
    decode_ids,
    encode_floats,
    encode_ids,
    expand,
    pack_int32,
)
from store.records import CallRecord, ChoiceRecord
from store.trajectories import assemble
from tests.conftest import conversation

# --- binary lists ------------------------------------------------------------------------------------


def test_int32_ids_round_trip_little_endian() -> None:
    ids = [0, 1, 151_935, 151_643, 2**31 - 1, -(2**31), 42]
    blob = encode_ids(ids)
    assert blob[0] == IDS_INT32 and len(blob) == 1 + 4 * len(ids)
    assert blob[1:5] == b"\x00\x00\x00\x00" and blob[9:13] == (151_935).to_bytes(4, "little")
    assert decode_ids(blob) == ids
    assert decode_ids(memoryview(blob)) == ids  # some drivers hand blobs back as memoryviews


def test_ids_beyond_int32_are_kept_exactly() -> None:
    wide = [1, 2**40, -(2**33)]
    assert encode_ids(wide)[0] == IDS_INT64 and decode_ids(encode_ids(wide)) == wide
    huge = [3, 2**63 + 5]  # beyond int64: JSON
    assert encode_ids(huge)[0] == IDS_JSON and decode_ids(encode_ids(huge)) == huge
    assert pack_int32([2**31]) is None


def test_empty_lists_are_empty_blobs() -> None:
    assert encode_ids([]) == b"" and decode_ids(b"") == [] and decode_ids(None) == []
    assert encode_floats([]) == b"" and decode_floats(b"") == [] and decode_floats(None) == []


def test_float32_only_when_lossless() -> None:
    single = array("f", [-0.1, -1e-7, -23.456, 0.0, -0.0, -math.inf]).tolist()  # float32 values in doubles
    blob = encode_floats(single)
    assert blob[0] == FLOATS_F32 and len(blob) == 1 + 4 * len(single)
    back = decode_floats(blob)
    assert back == single and math.copysign(1, back[4]) == -1.0

    doubles = [-0.1, -0.1234567890123456789, -1e-300]  # not float32 values: float64, exactly
    blob = encode_floats(doubles)
    assert blob[0] == FLOATS_F64 and len(blob) == 1 + 8 * len(doubles)
    assert decode_floats(blob) == doubles

    # One double among float32 values makes the whole list float64; too large for float32 too.
    assert encode_floats([*single, -0.1])[0] == FLOATS_F64
    assert decode_floats(encode_floats([*single, -0.1])) == [*single, -0.1]
    assert decode_floats(encode_floats([-1e300])) == [-1e300]
    nan = decode_floats(encode_floats([math.nan, -1.0]))
    assert math.isnan(nan[0]) and nan[1] == -1.0


def test_unknown_formats_are_refused() -> None:
    with pytest.raises(CorruptRollout):
        decode_ids(b"\x09\x00\x00\x00\x00")
    with pytest.raises(CorruptRollout):
        decode_floats(b"\x09\x00\x00\x00\x00")


def test_common_prefixes_match_a_naive_scan() -> None:
    rng = random.Random(3)
    for _ in range(300):
        a = [rng.randrange(5) for _ in range(rng.randrange(40))]
        b = a[: rng.randrange(len(a) + 1)] + [rng.randrange(5) for _ in range(rng.randrange(40))]
        naive = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        packed_a, packed_b = pack_int32(a), pack_int32(b)
        assert packed_a is not None and packed_b is not None
        assert common_prefix_int32(packed_a, packed_b) == naive
        assert common_prefix([bytes([x]) for x in a], [bytes([x]) for x in b]) == naive


# --- compaction --------------------------------------------------------------------------------------


def call(
    call_id: str, prompt: list[int], messages: list[dict[str, Any]], *choices: ChoiceRecord, **fields: Any
) -> CallRecord:
    values: dict[str, Any] = {
        "call_id": call_id,
        "rollout_id": "r",
        "rollout_explicit": True,
        "model": "agent",
        "step": 1,
        "upstream_model": "agent@1",
        "request": {"model": "agent", "messages": messages, "temperature": 0.5},
        "stream": False,
        "status": "ok",
        "http_status": 200,
        "error": None,
        "prompt_token_ids": prompt,
        "choices": list(choices),
        "usage": None,
        "started_at": float(int(call_id[1:])),
        "first_token_at": None,
        "ended_at": 100.0,
    }
    values.update(fields)
    return CallRecord(**values)


def reply(index: int, text: str, ids: list[int]) -> ChoiceRecord:
    return ChoiceRecord(index, {"role": "assistant", "content": text}, "stop", ids, [-0.5] * len(ids))


def store(records: list[CallRecord], keep: int = 4) -> tuple[list[dict[str, Any]], list[Head]]:
    """Compact records in order, each against the ones before (as the writer does), and check they expand."""
    rows, heads = [], []
    for record in records:
        row, head = compact(record, heads)
        rows.append(row)
        heads = [*heads, head][-keep:]
    assert expand(rows, explicit=True) == records
    return rows, heads


def test_an_extending_call_stores_only_what_it_adds() -> None:
    user = {"role": "user", "content": "hi"}
    first = call("c1", [1, 2, 3], [user], reply(0, "a", [4, 5]))
    tool = {"role": "tool", "content": "result"}
    second = call("c2", [1, 2, 3, 4, 5, 6, 7], [user, first.choices[0].message, tool], reply(0, "b", [8]))
    rows, _ = store([first, second])
    assert rows[0]["base_call_id"] is None and rows[0]["prompt_prefix_len"] == 0
    assert decode_ids(rows[0]["prompt_suffix"]) == [1, 2, 3] and rows[0]["messages_suffix"] == [user]
    assert rows[0]["request"] == {"model": "agent", "messages": None, "temperature": 0.5}  # messages: elsewhere
    row = rows[1]
    assert row["base_call_id"] == "c1"
    assert (row["prompt_base_choice"], row["prompt_prefix_len"], decode_ids(row["prompt_suffix"])) == (0, 5, [6, 7])
    assert (row["messages_base_choice"], row["messages_prefix_len"], row["messages_suffix"]) == (0, 2, [tool])
    assert row["request"] is None  # the same as the base's
    assert row["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "b"},
            "finish_reason": "stop",
            "tokens": 1,
            "logprobs": 1,
        }
    ]
    assert decode_ids(row["completion_ids"]) == [8] and decode_floats(row["completion_logprobs"]) == [-0.5]


def test_a_call_that_does_not_extend_shares_its_longest_common_prefix() -> None:
    system = {"role": "system", "content": "s"}
    first = call("c1", [1, 2, 3, 4], [system, {"role": "user", "content": "q"}], reply(0, "a", [5, 6]))
    # A re-rendered template: token 3 changed; the client edited the user message.
    second = call("c2", [1, 2, 9, 4, 5, 6, 7], [system, {"role": "user", "content": "q!"}], reply(0, "b", [8]))
    rows, _ = store([first, second])
    assert rows[1]["base_call_id"] == "c1"
    assert (rows[1]["prompt_base_choice"], rows[1]["prompt_prefix_len"]) == (None, 2)
    assert decode_ids(rows[1]["prompt_suffix"]) == [9, 4, 5, 6, 7]
    assert (rows[1]["messages_base_choice"], rows[1]["messages_prefix_len"]) == (None, 1)
    # Nothing shared at all: stored whole, but the request still points at the base's.
    third = call("c3", [7, 7], [{"role": "user", "content": "new"}])
    rows, _ = store([first, second, third])
    assert (rows[2]["base_call_id"], rows[2]["prompt_prefix_len"], rows[2]["messages_prefix_len"]) == ("c2", 0, 0)
    assert rows[2]["request"] is None
    other = call("c4", [8, 8], [{"role": "user", "content": "new"}], request={"model": "x", "messages": []})
    rows, _ = store([third, other])
    assert rows[1]["base_call_id"] is None and rows[1]["request"] == {"model": "x", "messages": None}


def test_a_cache_miss_stores_the_call_whole() -> None:
    records = conversation("miss", 3)
    row, _ = compact(records[2], [])
    assert row["base_call_id"] is None and row["prompt_prefix_len"] == 0 and row["messages_prefix_len"] == 0
    assert decode_ids(row["prompt_suffix"]) == records[2].prompt_token_ids
    assert expand([row], explicit=True) == [records[2]]


def test_a_choice_of_an_n_gt_1_call_is_a_base() -> None:
    user = {"role": "user", "content": "hi"}
    first = call("c1", [1, 2], [user], reply(0, "a", [3, 4]), reply(1, "b", [5, 6, 7]))
    second = call("c2", [1, 2, 5, 6, 7, 8], [user, first.choices[1].message, {"role": "user", "content": "go"}])
    rows, _ = store([first, second])
    assert decode_ids(rows[0]["completion_ids"]) == [3, 4, 5, 6, 7]
    assert [c["tokens"] for c in rows[0]["choices"]] == [2, 3]
    assert (rows[1]["prompt_base_choice"], rows[1]["prompt_prefix_len"]) == (1, 5)
    assert (rows[1]["messages_base_choice"], rows[1]["messages_prefix_len"]) == (1, 2)


def test_the_best_of_several_heads_is_the_base() -> None:
    """Two sub-agents interleaved in one rollout: each call is stored against its own agent's last call."""
    a1 = call("c1", [1, 1, 1], [{"role": "user", "content": "a"}], reply(0, "x", [2]))
    b1 = call("c2", [9, 9, 9], [{"role": "user", "content": "b"}], reply(0, "y", [8]))
    a2 = call("c3", [1, 1, 1, 2, 3], [{"role": "user", "content": "a"}, a1.choices[0].message])
    b2 = call("c4", [9, 9, 9, 8, 7], [{"role": "user", "content": "b"}, b1.choices[0].message])
    rows, _ = store([a1, b1, a2, b2])
    assert [r["base_call_id"] for r in rows] == [None, "c1", "c1", "c2"]  # b1 shares only the request with a1
    assert [r["prompt_prefix_len"] for r in rows] == [0, 0, 4, 4]


def test_json_values_that_python_calls_equal_are_not_shared() -> None:
    """1 == 1.0 == True in Python; the stored JSON must still be what was sent."""
    first = call("c1", [1], [], reply(0, "a", [2]), request={"model": "agent", "t": 1, "messages": [{"n": 1}]})
    second = call("c2", [1, 2], [], request={"model": "agent", "t": 1.0, "messages": [{"n": True}]})
    third = call("c3", [1, 2], [], request={"model": "agent", "t": 1, "messages": [{"n": 1.0}]})
    rows, _ = store([first, second, third])
    assert [r["messages_prefix_len"] for r in rows] == [0, 0, 0]
    assert rows[1]["request"] == {"model": "agent", "t": 1.0, "messages": None}  # not the first's, whose t is 1
    assert (rows[2]["base_call_id"], rows[2]["request"]) == ("c1", None)  # the same t as the first's
    back = expand(rows, explicit=True)
    assert msgspec.json.encode(back) == msgspec.json.encode([first, second, third])


def test_requests_without_messages_round_trip() -> None:
    completion = call("c1", [1, 2], [], reply(0, "a", [3]), request={"model": "agent", "prompt": "hi"})
    odd = call("c2", [1, 2, 3], [], request={"model": "agent", "messages": "not a list"})
    same = call("c3", [1, 2, 3, 4], [], request={"model": "agent", "messages": "not a list"})
    rows, _ = store([completion, odd, same])
    assert [r["messages_suffix"] for r in rows] == [None, None, None]
    assert [r["messages_prefix_len"] for r in rows] == [None, None, None]
    assert rows[2]["request"] is None


def test_irregular_conversations_round_trip_and_assemble_the_same() -> None:
    for calls in (1, 2, 10, 31):
        records = conversation(f"irregular-{calls}", calls, irregular=True)
        rows, _ = store(records)
        back = expand(rows, explicit=True)
        assert msgspec.json.encode(assemble("r", back)) == msgspec.json.encode(assemble("r", records))
        if calls > 10:
            assert sum(r["base_call_id"] is not None for r in rows) == len(rows) - 1
            assert {r["completion_logprobs"][0] for r in rows if r["completion_logprobs"]} == {1, 2}


def test_stored_prompt_bytes_grow_linearly() -> None:
    records = conversation("linear", 30)
    rows, _ = store(records)
    final = len(records[-1].prompt_token_ids)
    stored = sum(len(r["prompt_suffix"]) for r in rows)
    assert stored <= 4 * final + len(rows)  # each prompt token stored once (+ a format byte per call)
    assert all(r["prompt_base_choice"] == 0 for r in rows[1:])


def test_ids_beyond_int32_never_break_a_rollout() -> None:
    first = call("c1", [1, 2**40], [{"role": "user", "content": "x"}], reply(0, "a", [2**35]))
    second = call("c2", [1, 2**40, 2**35, 4], [{"role": "user", "content": "x"}])
    rows, _ = store([first, second])
    assert rows[1]["prompt_prefix_len"] == 0 and rows[1]["messages_prefix_len"] == 1


# --- expansion ---------------------------------------------------------------------------------------


def test_a_chain_of_a_thousand_calls_does_not_recurse() -> None:
    records = [
        call(f"c{k}", list(range(k)), [{"role": "user", "content": str(i)} for i in range(k)]) for k in range(1000)
    ]
    heads: list[Head] = []
    rows = []
    for record in records:
        row, head = compact(record, heads)
        rows.append(row)
        heads = [head]
    assert all(row["base_call_id"] == f"c{k}" for k, row in enumerate(rows[2:], 1))
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(200)
    try:
        back = expand(list(reversed(rows)), explicit=True)  # newest first: the longest walk down
    finally:
        sys.setrecursionlimit(limit)
    assert back == list(reversed(records))


def test_a_missing_or_looping_base_is_an_error_not_a_hang() -> None:
    records = conversation("broken", 3)
    rows, _ = store(records)
    with pytest.raises(CorruptRollout, match="not found"):
        expand(rows[1:], explicit=True)
    looped = [{**rows[1], "base_call_id": rows[2]["id"]}, rows[2]]
    with pytest.raises(CorruptRollout, match="loop"):
        expand(looped, explicit=True)


# --- the cache ---------------------------------------------------------------------------------------


def head(call_id: str, size: int) -> Head:
    return Head(call_id, b"", [], None, [], b"{}", size)


def test_cache_holds_only_committed_heads() -> None:
    cache = CallCache()
    cache.stage({"r": [head("a", 10)]})
    assert cache.heads("r") == []
    cache.committed()
    assert [h.call_id for h in cache.heads("r")] == ["a"]
    cache.stage({"r": [head("a", 10), head("b", 10)]})
    cache.discard()  # the transaction failed
    cache.committed()
    assert [h.call_id for h in cache.heads("r")] == ["a"] and cache.size == 10


def test_cache_is_bounded_by_bytes_rollouts_and_heads_per_rollout() -> None:
    cache = CallCache(max_bytes=100, max_rollouts=3, per_rollout=2)
    cache.stage({"r": [head("a", 10), head("b", 10), head("c", 10)]})
    cache.committed()
    assert [h.call_id for h in cache.heads("r")] == ["b", "c"] and cache.size == 20
    cache.stage({"s": [head("s1", 50)], "t": [head("t1", 20)]})
    cache.committed()
    assert len(cache) == 3 and cache.size == 90
    cache.stage({"r": [head("c", 10), head("d", 10)]})  # r written again: the most recently used
    cache.committed()
    cache.stage({"u": [head("u1", 30)]})  # over the byte budget: the least recently used go first
    cache.committed()
    assert cache.heads("s") == [] and [h.call_id for h in cache.heads("t")] == ["t1"]
    assert [h.call_id for h in cache.heads("r")] == ["c", "d"] and cache.size == 70
    cache.stage({"v": [head("v1", 1000)]})  # larger than the whole budget: not cached, nothing evicted
    cache.committed()
    assert cache.heads("v") == [] and len(cache) == 3 and cache.size == 70
    cache.stage({"w": [head("w1", 1)]})  # over the rollout count
    cache.committed()
    assert len(cache) == 3 and cache.heads("t") == [] and cache.size == 51
