"""The simulated model as pure functions: tokenizer round trips, the chat template's continuation identity, and
exact continuation of generated answers."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from vllm_etcd_proxy.sim import tokens
from vllm_etcd_proxy.sim.tokens import complete, decode, encode, render_chat

ids = st.integers(0, tokens.VOCAB_SIZE - 1)
prompts = st.lists(ids, min_size=1, max_size=60)
words = st.text(alphabet=st.characters(blacklist_categories=["Z", "C"]), min_size=1, max_size=12)
texts = st.lists(words, max_size=20).map(" ".join)
roles = st.sampled_from(["system", "user", "assistant", "tool", "developer", "critic"])
chats = st.lists(st.tuples(roles, texts), min_size=1, max_size=5)


def test_words_hash_stably_across_processes() -> None:
    # Pinned values: another node (another process, another release) must tokenize a prompt the same way.
    assert encode("hi there") == [29718, 13535]
    hashed = [encode(word)[0] for word in ("tok16x", "tok017", "tok5")]
    assert all(t >= tokens.FIRST_PROMPT for t in hashed)
    user = tokens.SPECIALS.index("<|user|>")
    assert encode("  tok17\ttok4095\n<|user|> tok16x tok017 tok5") == [17, 4095, user, *hashed]


@given(st.lists(ids, max_size=60))
def test_text_of_any_ids_tokenizes_back_to_them(token_ids: list[int]) -> None:
    assert encode(decode(token_ids)) == token_ids


@given(texts)
def test_prompt_words_never_look_generated(text: str) -> None:
    assert all(not tokens.is_generated(t) or decode([t]).strip() in text.split() for t in encode(text))


@given(chats, texts)
def test_continuing_a_partial_assistant_message_extends_the_generation_prompt(
    chat: list[tuple[str, str]], partial: str
) -> None:
    opened = render_chat(chat, add_generation_prompt=True, continue_final_message=False)
    continued = render_chat([*chat, ("assistant", partial)], add_generation_prompt=False, continue_final_message=True)
    assert continued == opened + encode(partial)


def test_chat_template_shape() -> None:
    chat = [("system", "be brief"), ("user", "hi")]
    assert decode(render_chat(chat, add_generation_prompt=True, continue_final_message=False)) == (
        " <|system|> tok" + str(encode("be")[0]) + " tok" + str(encode("brief")[0]) + " <|end|>"
        " <|user|> tok" + str(encode("hi")[0]) + " <|end|> <|assistant|>"
    )
    assert render_chat(chat, add_generation_prompt=False, continue_final_message=False)[-1] == tokens.END
    assert render_chat([("critic", "")], add_generation_prompt=False, continue_final_message=False) == [
        tokens.OTHER_ROLE,
        *encode("critic"),
        tokens.END,
    ]


@given(prompts, st.one_of(st.none(), st.integers(1, 40)), st.integers(0, 30), st.booleans(), st.data())
def test_a_continuation_yields_exactly_the_rest_of_the_answer(
    prompt: list[int], max_tokens: int | None, output_len: int, ignore_eos: bool, data: st.DataObject
) -> None:
    answer = complete(prompt, max_tokens=max_tokens, output_len=output_len, ignore_eos=ignore_eos)
    assert all(tokens.is_generated(t) for t in answer.tokens)
    assert encode(decode(answer.tokens)) == list(answer.tokens)
    k = data.draw(st.integers(0, len(answer.tokens)), label="k")
    rest = complete(
        [*prompt, *answer.tokens[:k]],
        max_tokens=None if max_tokens is None else max_tokens - k,
        output_len=output_len,
        ignore_eos=ignore_eos,
    )
    assert rest.tokens == answer.tokens[k:] and rest.finish_reason == answer.finish_reason


@given(prompts, st.integers(1, 40), st.integers(1, 30))
def test_answer_length_is_output_len_unless_max_tokens_comes_first(prompt: list[int], max_tokens: int, n: int) -> None:
    prompt = [*prompt, tokens.ASSISTANT]
    answer = complete(prompt, max_tokens=max_tokens, output_len=n)
    assert (len(answer.tokens), answer.finish_reason) == ((max_tokens, "length") if max_tokens <= n else (n, "stop"))
    assert len(complete(prompt, max_tokens=None, output_len=n).tokens) == n
    assert len(complete(prompt, max_tokens=max_tokens, output_len=n, ignore_eos=True).tokens) == max_tokens


def test_the_answer_depends_on_the_whole_context() -> None:
    base = encode("you are a helpful assistant and this is a long system prompt") + [tokens.ASSISTANT]
    changed = [base[0] + 1, *base[1:]]
    first = complete(base, max_tokens=None, output_len=16).tokens
    assert first != complete(changed, max_tokens=None, output_len=16).tokens
    assert len(set(first)) > 8, "the answer should not cycle on a few tokens"


def test_a_finished_answer_continues_with_nothing() -> None:
    prompt = [tokens.ASSISTANT]
    answer = complete(prompt, max_tokens=None, output_len=5)
    done = complete([*prompt, *answer.tokens], max_tokens=None, output_len=5)
    assert (done.tokens, done.finish_reason) == ((), "stop")
