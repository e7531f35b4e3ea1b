"""client/'s ArtClient against a real gateway (in front of the stand-in engine, tests/stub_engine.py): the keys and
groups it sends and reads are the server's own structs (store/api.py), so each call here round-trips through the
gateway's decoding and encoding of them, errors included."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import pytest

from client import ArtClient, GatewayRefused
from store.api import GroupCreate, KeyCreate, RolloutIn
from tests.conftest import GatewayProcess, gateway_on_stub

MODEL = "my-agent"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    with gateway_on_stub(tmp_path_factory.mktemp("client"), "--auth", "required") as started:
        yield started


@pytest.fixture
def admin(gateway: GatewayProcess) -> Iterator[ArtClient]:
    with ArtClient(gateway.url, gateway.admin_key) as client:
        yield client


def record(gateway: GatewayProcess, key: str) -> str:
    """One rollout, recorded through the gateway with `key` (the stand-in engine answers)."""
    rollout_id = f"r-{uuid.uuid4().hex[:10]}"
    answer = httpx.post(
        f"{gateway.base_url}/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        headers={"Authorization": f"Bearer {key}", "X-ART-Rollout-Id": rollout_id},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    return rollout_id


def test_keys_are_made_listed_and_revoked(admin: ArtClient, gateway: GatewayProcess) -> None:
    made = admin.create_key(KeyCreate(name="bot", models=[MODEL], scopes=["reward", "read"], rpm=600))
    assert made.key.startswith("sk-art-") and made.name == "bot" and made.models == [MODEL]
    assert made.scopes == ["read", "reward"] and made.rpm == 600 and made.tpm is None
    listed = {key.id: key for key in admin.keys()}
    assert made.key not in repr(listed)  # listings never carry the secret
    assert listed[made.id].prefix == made.key[: len("sk-art-") + 4] and listed[made.id].revoked_at is None
    # The client key reads what its scopes allow, not the admin API.
    with ArtClient(gateway.url, made.key) as client:
        assert client.models() == [MODEL]
        with pytest.raises(GatewayRefused) as refused:
            client.keys()
        assert refused.value.status == 403

    revoked = admin.revoke_key(made.id)
    assert revoked.id == made.id and revoked.revoked_at is not None
    assert made.id not in {key.id for key in admin.keys()}
    assert {key.id: key for key in admin.keys(include_revoked=True)}[made.id].revoked_at == revoked.revoked_at
    with ArtClient(gateway.url, made.key) as client, pytest.raises(GatewayRefused) as refused:
        client.models()
    assert refused.value.status == 401

    with pytest.raises(GatewayRefused) as refused:
        admin.revoke_key("no/such key")  # one path segment, quoted
    assert refused.value.status == 404
    # What the server checks (here a scope it does not know) comes back as its 400, its message whole.
    with pytest.raises(GatewayRefused, match="scopes") as refused:
        admin.create_key(KeyCreate(name="bad", scopes=["fly"]))  # type: ignore[list-item]
    assert refused.value.status == 400


def test_groups_are_posted_read_and_paged(admin: ArtClient, gateway: GatewayProcess) -> None:
    key = admin.create_key(KeyCreate(name="agent", models=[MODEL], scopes=["infer", "reward", "read"])).key
    prefix = uuid.uuid4().hex[:6]
    with ArtClient(gateway.url, key) as agent:
        posted = []
        for n in range(3):
            rollouts = [record(gateway, key) for _ in range(2)]
            spec = GroupCreate(
                model=MODEL,
                rollouts=[RolloutIn(rollouts[0], 1.0, {"len": 3.0}), RolloutIn(rollouts[1], 0.0)],
                group_id=f"{prefix}-{n}",
                metadata={"n": n},
            )
            group = agent.post_group(spec)
            assert group.id == group.group_id == spec.group_id and group.state == "ready"
            assert group.reward_mean == 0.5 and group.metadata == {"n": n} and group.no_signal is False
            assert [(r.rollout_id, r.caller_reward, r.metrics) for r in group.rollouts] == [
                (rollouts[0], 1.0, {"len": 3.0}),
                (rollouts[1], 0.0, None),
            ]
            assert agent.post_group(spec) == group  # the same request again: the same group
            posted.append(group)
        assert agent.group(posted[1].id) == posted[1]

        # One page at a time: oldest first, each page's cursor asking for the next.
        first = agent.group_page(model=MODEL, limit=2)
        assert [g.id for g in first.data] == [posted[0].id, posted[1].id] and first.next_cursor is not None
        rest = agent.group_page(model=MODEL, limit=2, cursor=first.next_cursor)
        assert [g.id for g in rest.data] == [posted[2].id] and rest.next_cursor is None
        # ... or every group, read a page at a time.
        assert list(agent.groups(model=MODEL, page=1)) == posted
        assert list(agent.groups(model=MODEL, state="ready")) == posted
        assert list(agent.groups(model=MODEL, state="trained")) == []

        with pytest.raises(GatewayRefused) as refused:
            agent.group("no-such-group")
        assert refused.value.status == 404
        # An idempotency key over another body: the server's 409.
        other = GroupCreate(MODEL, [RolloutIn(record(gateway, key), 1.0), RolloutIn(record(gateway, key), 0.0)])
        made = agent.post_group(other, idempotency_key=f"{prefix}-once")
        assert agent.post_group(other, idempotency_key=f"{prefix}-once") == made
        changed = GroupCreate(MODEL, [RolloutIn(r.rollout_id, 0.5) for r in other.rollouts])
        with pytest.raises(GatewayRefused) as refused:
            agent.post_group(changed, idempotency_key=f"{prefix}-once")
        assert refused.value.status == 409


def test_a_key_without_the_reward_scope_cannot_post(admin: ArtClient, gateway: GatewayProcess) -> None:
    reader = admin.create_key(KeyCreate(name="reader", models=[MODEL], scopes=["infer", "read"])).key
    rollouts = [record(gateway, reader) for _ in range(2)]
    with ArtClient(gateway.url, reader) as client, pytest.raises(GatewayRefused) as refused:
        client.post_group(GroupCreate(MODEL, [RolloutIn(r, float(i)) for i, r in enumerate(rollouts)]))
    assert refused.value.status == 403
