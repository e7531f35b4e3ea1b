"""The token arithmetic of a splice (gateway/splicing.py): hand-computed ids of a toy template, no engine.

The toy's ids: a ChatML-like template (`<|im_start|>` 90, `<|im_end|>` 91, `\\n` 92; roles user 80, assistant 81,
tool 82) and a Mistral-like one (`</s>` 2, `[INST]` 3, `[/INST]` 4, `[TOOL_CALLS]` 5, `[TOOL_RESULTS]` 7,
`[/TOOL_RESULTS]` 8). The two sentinel texts tokenize as [60, 61, 70] and [60, 61, 71]: they differ at their end.
"""

from __future__ import annotations

from gateway.splicing import (
    CallsReply,
    CallsReplyAsText,
    Mismatch,
    Spliced,
    TextReply,
    splice_ids,
    turn_tail,
)

SENT_A, SENT_Z = [60, 61, 70], [60, 61, 71]
IM_END, NL = 91, 92
TAIL = [IM_END, NL]  # ChatML's end of an assistant turn

# The previous call's prompt: a user turn (its text 5), then the generation prompt.
PROMPT = [90, 80, NL, 5, IM_END, NL, 90, 81, NL]
# The new messages as the request renders them after the reply's turn: a user turn (8), the generation prompt.
NEW_USER = [90, 80, NL, 8, IM_END, NL, 90, 81, NL]
NEW_TOOL = [90, 82, NL, 9, IM_END, NL, 90, 81, NL]  # a tool result (9) instead


def _text(sentinel: list[int]) -> list[int]:
    """The request rendered with a text reply of `sentinel`."""
    return [*PROMPT, *sentinel, *TAIL, *NEW_USER]


def test_a_text_reply_that_ended_on_its_stop_token_goes_on_with_the_rest_of_its_end_of_turn() -> None:
    sampled = [6, 7, IM_END]
    spliced = splice_ids(TextReply(_text(SENT_A), _text(SENT_Z)), PROMPT + sampled, sampled, unasked_max_tokens=None)
    # the model's own <|im_end|> is not added again: only the `\n` after it, then the new messages
    assert spliced == Spliced([*PROMPT, 6, 7, IM_END, NL, *NEW_USER], None)


def test_a_text_reply_cut_at_its_length_gets_the_whole_end_of_turn() -> None:
    sampled = [6, 7]
    spliced = splice_ids(TextReply(_text(SENT_A), _text(SENT_Z)), PROMPT + sampled, sampled, unasked_max_tokens=None)
    assert spliced == Spliced([*PROMPT, 6, 7, IM_END, NL, *NEW_USER], None)


def test_the_history_before_the_reply_is_the_recorded_prompt_not_the_render() -> None:
    """Qwen3's template drops an earlier turn's reasoning from the render: the splice keeps the recorded ids."""
    rendered = [90, 80, NL, 5, IM_END, NL, 90, 81, NL]  # the render of the history, its reasoning (4) gone
    recorded = [90, 80, NL, 5, IM_END, NL, 90, 81, NL, 4]  # what the reply was sampled after
    sampled = [6, IM_END]

    def text(sentinel: list[int]) -> list[int]:
        return [*rendered, *sentinel, *TAIL, *NEW_USER]

    spliced = splice_ids(TextReply(text(SENT_A), text(SENT_Z)), recorded + sampled, sampled, unasked_max_tokens=None)
    assert spliced == Spliced([*recorded, 6, IM_END, NL, *NEW_USER], None)


def test_no_new_message_rendered_leaves_the_prefix_and_the_end_of_turn() -> None:
    """New messages that render to nothing (the request's render ends at the reply's end of turn)."""
    sampled = [6]
    renders = TextReply([*PROMPT, *SENT_A, IM_END], [*PROMPT, *SENT_Z, IM_END])
    assert splice_ids(renders, PROMPT + sampled, sampled, unasked_max_tokens=None) == Spliced(
        [*PROMPT, 6, IM_END], None
    )
    sampled = [6, IM_END]
    assert splice_ids(renders, PROMPT + sampled, sampled, unasked_max_tokens=None) == Spliced(PROMPT + sampled, None)


def test_a_text_reply_the_template_does_not_render_is_a_mismatch() -> None:
    sampled = [6, IM_END]
    unrendered = [*PROMPT, *TAIL, *NEW_USER]  # the reply's text left out: both renders the same
    assert splice_ids(
        TextReply(unrendered, unrendered), PROMPT + sampled, sampled, unasked_max_tokens=None
    ) == Mismatch("reply_not_rendered")
    # nothing after the reply's text: the renders share no end
    ends = TextReply([*PROMPT, *SENT_A], [*PROMPT, *SENT_Z])
    assert splice_ids(ends, PROMPT + sampled, sampled, unasked_max_tokens=None) == Mismatch("reply_not_rendered")
    assert Mismatch("reply_not_rendered").reason == "template_mismatch"


def test_the_unasked_max_tokens_moves_by_the_splices_length() -> None:
    """vLLM's default max_tokens is what the context leaves after the prompt it rendered (the first render's):
    the splice's prompt is another length, and one that leaves no token to sample is not spliced."""
    sampled = [6, 7, IM_END]
    renders = TextReply(_text(SENT_A), _text(SENT_Z))  # 9 + 3 + 2 + 9 = 23 ids
    spliced = splice_ids(renders, PROMPT + sampled, sampled, unasked_max_tokens=100)
    assert isinstance(spliced, Spliced)
    assert len(spliced.prompt_ids) == 22  # 9 + 3 + 1 + 9
    assert spliced.max_tokens == 101  # 100 + 23 - 22
    assert splice_ids(renders, PROMPT + sampled, sampled, unasked_max_tokens=1) == Spliced(spliced.prompt_ids, 2)
    longer = [*PROMPT, 6, 6, 6, 6, 7, IM_END]  # a prefix 3 ids longer than the render's history: 25 ids spliced
    assert splice_ids(renders, longer, sampled, unasked_max_tokens=3) == Spliced([*longer, NL, *NEW_USER], 1)
    assert splice_ids(renders, longer, sampled, unasked_max_tokens=2) == Mismatch("no_room")


# ---------------------------------------------------------------- a reply with tool calls, ChatML-like

CALL_MARKUP = [95, 40, 41, 96]  # how the template renders the reply's tool call: <tool_call>{...}</tool_call>


def _calls(request: bool, sentinel: list[int], markup: list[int] = CALL_MARKUP) -> list[int]:
    """The request (or the history through the reply, no generation prompt) rendered with `sentinel` as the
    reply's text, its tool call after it."""
    return [*PROMPT, *sentinel, *markup, *TAIL, *(NEW_TOOL if request else ())]


def _calls_reply(**changed: list[int]) -> CallsReply:
    fields = dict(
        request_a=_calls(True, SENT_A),
        request_z=_calls(True, SENT_Z),
        through_a=_calls(False, SENT_A),
        through_z=_calls(False, SENT_Z),
        tail=TAIL,
    )
    return CallsReply(**{**fields, **changed})


def test_a_tool_call_reply_keeps_its_sampled_call_not_the_templates_rendering_of_it() -> None:
    sampled = [95, 42, 43, 44, 96, IM_END]  # the call as sampled: other ids than the template renders ([40, 41])
    spliced = splice_ids(_calls_reply(), PROMPT + sampled, sampled, unasked_max_tokens=None)
    assert spliced == Spliced([*PROMPT, *sampled, NL, *NEW_TOOL], None)


def test_a_tool_call_reply_cut_at_its_length_gets_the_whole_end_of_turn() -> None:
    sampled = [95, 42, 43]
    spliced = splice_ids(_calls_reply(), PROMPT + sampled, sampled, unasked_max_tokens=None)
    assert spliced == Spliced([*PROMPT, *sampled, *TAIL, *NEW_TOOL], None)


def test_tool_call_renders_that_do_not_show_where_the_reply_ends_are_mismatches() -> None:
    sampled = [95, 42, 96, IM_END]
    cases = {
        "the request renders no reply text": (
            _calls_reply(request_z=_calls(True, SENT_A)),
            "reply_not_rendered",
        ),
        "the template renders no end of turn": (_calls_reply(tail=[]), "calls_not_found"),
        "the history through the reply renders no reply text": (
            _calls_reply(through_z=_calls(False, SENT_A)),
            "calls_not_found",
        ),
        "the request renders the call otherwise than the history through it": (
            _calls_reply(request_a=_calls(True, SENT_A, [95, 40, 96]), request_z=_calls(True, SENT_Z, [95, 40, 96])),
            "calls_not_found",
        ),
        "the history through the reply does not end with the end of turn": (
            _calls_reply(tail=[IM_END, 93]),
            "calls_not_found",
        ),
    }
    for name, (renders, check) in cases.items():
        assert splice_ids(renders, PROMPT + sampled, sampled, unasked_max_tokens=None) == Mismatch(check), name


# ---------------------------------------------------------------- a reply with tool calls, Mistral-like

M_PROMPT = [1, 3, 5 + 50, 4]  # <s>[INST] the user's text [/INST]
M_RESULT = [7, 9, 8]  # [TOOL_RESULTS] the result [/TOOL_RESULTS]
M_CALL = [5, 40, 41]  # [TOOL_CALLS] the template's rendering of the call


def _as_text(sentinel: list[int]) -> list[int]:
    return [*M_PROMPT, *sentinel, 2, *M_RESULT]


def test_a_mistral_tool_call_reply_is_spliced_from_the_renders_with_a_text_reply_in_its_place() -> None:
    """mistral_common renders no history ending with an assistant turn: what follows a text reply of each
    sentinel (`</s>`, then the new messages) must end the request's render as sent."""
    renders = CallsReplyAsText([*M_PROMPT, *M_CALL, 2, *M_RESULT], _as_text(SENT_A), _as_text(SENT_Z))
    sampled = [5, 42, 43, 2]  # ended on its </s>
    spliced = splice_ids(renders, M_PROMPT + sampled, sampled, unasked_max_tokens=None)
    assert spliced == Spliced([*M_PROMPT, *sampled, *M_RESULT], None)
    sampled = [5, 42]  # cut at its length: </s> added
    spliced = splice_ids(renders, M_PROMPT + sampled, sampled, unasked_max_tokens=None)
    assert spliced == Spliced([*M_PROMPT, *sampled, 2, *M_RESULT], None)


def test_mistral_renders_that_do_not_show_where_the_reply_ends_are_mismatches() -> None:
    sampled = [5, 42, 2]
    as_sent = [*M_PROMPT, *M_CALL, 2, *M_RESULT]
    cases = {
        "the text reply not rendered": (
            CallsReplyAsText(as_sent, _as_text(SENT_A), _as_text(SENT_A)),
            "reply_not_rendered",
        ),
        "nothing after the text reply": (
            CallsReplyAsText(as_sent, [*M_PROMPT, *SENT_A], [*M_PROMPT, *SENT_Z]),
            "reply_not_rendered",
        ),
        "the request as sent renders the result otherwise": (
            CallsReplyAsText([*M_PROMPT, *M_CALL, 2, 7, 9, 9, 8], _as_text(SENT_A), _as_text(SENT_Z)),
            "as_sent_differs",
        ),
        "the request as sent no longer than what follows the text": (
            CallsReplyAsText([2, *M_RESULT], _as_text(SENT_A), _as_text(SENT_Z)),
            "as_sent_differs",
        ),
    }
    for name, (renders, check) in cases.items():
        assert splice_ids(renders, M_PROMPT + sampled, sampled, unasked_max_tokens=None) == Mismatch(check), name


def test_the_end_of_an_assistant_turn_is_what_a_one_turn_history_ends_with_after_each_sentinel() -> None:
    one_turn = [90, 80, NL, 88, IM_END, NL, 90, 81, NL]
    assert turn_tail([*one_turn, *SENT_A, *TAIL], [*one_turn, *SENT_Z, *TAIL]) == TAIL
    assert turn_tail([*one_turn, *SENT_A], [*one_turn, *SENT_Z]) == []  # nothing after the text
    assert turn_tail(one_turn, one_turn) == []  # the text not rendered
