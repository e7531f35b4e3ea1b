from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer

from artgw.tiny_model import TinyModelSpec, build_tiny_model, fingerprint


def test_same_seed_same_bytes_other_seed_differs(tmp_path: Path, tiny_model: Path) -> None:
    again = build_tiny_model(tmp_path / "again")
    other = build_tiny_model(tmp_path / "other", TinyModelSpec(seed=1))
    assert fingerprint(again) == fingerprint(tiny_model)
    assert fingerprint(other) != fingerprint(tiny_model)


def test_chat_template_renders_tools_and_tool_calls_hermes_style(tiny_model: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "user", "content": "weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    text = tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    # The tool parser needs the markers as single tokens that survive skip_special_tokens.
    ids = tok.encode("<tool_call>")
    assert len(ids) == 1
    assert tok.decode(ids, skip_special_tokens=True) == "<tool_call>"


def test_every_token_decodes_to_text_and_encoding_roundtrips(tiny_model: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_model)
    sample = 'Hello world! {"a": [1, 2.5, -3]}\tok\n'
    assert tok.decode(tok.encode(sample)) == sample
    for token_id in range(len(tok)):
        piece = tok.decode([token_id])
        assert "\ufffd" not in piece, token_id  # no partial UTF-8: decoded ids are exactly the text


def test_token_ids_the_tests_pin(tiny_model: Path) -> None:
    from tests.conftest import END_TOKEN, QUOTE_TOKEN

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    assert tokenizer.convert_tokens_to_ids('"') == QUOTE_TOKEN
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == END_TOKEN == tokenizer.eos_token_id
