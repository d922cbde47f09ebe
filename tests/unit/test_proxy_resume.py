"""Request migration (yrpd/proxy/resume.py and the proxy's use of it): an answer whose decode instance breaks off
goes on on another instance, and the client reads what an unbroken run would have sent it, byte for byte.

The instances are fakes answering from a toy model in vLLM 0.32's format (tests/unit/proxy_fakes.py); each case is
run twice through the real proxy, once with a break and once without, and the client's bytes compared."""

import asyncio
import json
import re

import pytest

from tests.unit.proxy_fakes import HELD, Breaks, running, toy_answer, toy_chat_prompt, toy_held, toy_text, \
    toy_tokens, until
from yrpd.proxy import resume
from yrpd.proxy.resume import MAX_MIGRATIONS

PROMPT = "the quick brown fox jumps over the lazy dog"
MESSAGES = [{"role": "user", "content": PROMPT}]
N = 10


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


async def ask(setup, path: str, body: dict) -> tuple[int, bytes]:
    async with setup.client.post(setup.url + path, json=body, headers={"X-Request-Id": "r1"}) as r:
        return r.status, await r.read()


def events(data: bytes) -> list[str]:
    return [e.removeprefix("data: ") for e in data.decode().split("\n\n") if e]


async def unbroken(path: str, body: dict, held: bool = False) -> bytes:
    async with running(prefill=1, decode=2, toy=True, held=held) as s:
        status, data = await ask(s, path, body)
        assert status == 200, data
        return data


async def broken(path: str, body: dict, breaks: Breaks, held: bool = False, detokenize: int = 200):
    """(status, the client's bytes, the setup's decode fakes) of one request whose first stream breaks."""
    async with running(prefill=1, decode=2, toy=True, held=held) as s:
        for fake in s.decode:
            fake.breaks = breaks
            fake.detokenize_status = detokenize
        status, data = await ask(s, path, body)
        return status, data, s.decode, await s.metrics()


def answer_text(data: bytes) -> str:
    """The answer's text in a client's stream (completion or chat)."""
    out = ""
    for e in events(data):
        if e.startswith("{"):
            for c in json.loads(e)["choices"]:
                out += c.get("text") or (c.get("delta") or {}).get("content") or ""
    return out


def continuation_of(decode) -> tuple[str, dict]:
    """The continuation the decode fakes were sent: the last request whose body's prompt is token ids."""
    sent = [(path, body) for fake in decode for path, body in zip(fake.paths, fake.bodies)
            if isinstance(body.get("prompt"), list)]
    assert len(sent) == 1, sent
    return sent[0]


def completion(**more) -> dict:
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": N, "temperature": 0, "stream": True, **more}


def chat(**more) -> dict:
    return {"model": "tiny", "messages": MESSAGES, "max_completion_tokens": N, "temperature": 0, "stream": True,
            **more}


USAGE = {"stream_options": {"include_usage": True}}


@pytest.mark.parametrize("kind", ["between", "inside", "error", "eof"])
def test_a_completion_stream_that_breaks_goes_on_elsewhere_and_the_client_reads_the_unbroken_stream(kind):
    async def go():
        body = completion(**USAGE)
        want = await unbroken("/v1/completions", body)
        status, got, decode, metrics = await broken("/v1/completions", body, Breaks(kind, after=3))
        assert status == 200
        assert got == want, (events(got), events(want))
        # the continuation: the prompt's ids and the 3 sent, by token id, for what was left of max_tokens
        path, sent = continuation_of(decode)
        prompt_ids = toy_tokens(PROMPT)
        assert path == "/v1/completions" and sent["prompt"] == [*prompt_ids, *toy_answer(prompt_ids, N)[:3]]
        assert sent["max_tokens"] == N - 3 and sent["stream"] and sent["return_token_ids"]
        assert 'yrpd_proxy_migrations_total{outcome="carried over"} 1' in metrics
        # every token once, in order; one [DONE]; usage over the whole answer
        texts = [json.loads(e)["choices"][0]["text"] for e in events(got)[:-1] if json.loads(e)["choices"]]
        assert "".join(texts) == "".join(map(toy_text, toy_answer(prompt_ids, N)))
        assert events(got).count("[DONE]") == 1 and "error" not in got.decode()
        assert json.loads(events(got)[-2])["usage"] == {"prompt_tokens": len(prompt_ids),
                                                        "total_tokens": len(prompt_ids) + N, "completion_tokens": N}
    run(go())


@pytest.mark.parametrize("kind", ["between", "inside", "error", "eof"])
def test_a_chat_stream_that_breaks_goes_on_as_a_completion_and_the_client_reads_chat_chunks_as_unbroken(kind):
    async def go():
        body = chat(**USAGE)
        want = await unbroken("/v1/chat/completions", body)
        status, got, decode, _ = await broken("/v1/chat/completions", body, Breaks(kind, after=4))
        assert status == 200
        assert got == want, (events(got), events(want))
        path, sent = continuation_of(decode)
        prompt_ids = toy_chat_prompt(MESSAGES)
        # the chat template's ids as the instance gave them, then the answer's first 4: nothing tokenized again
        assert path == "/v1/completions" and sent["prompt"] == [*prompt_ids, *toy_answer(prompt_ids, N)[:4]]
        assert sent["max_tokens"] == N - 4 and "messages" not in sent and sent["temperature"] == 0
    run(go())


@pytest.mark.parametrize("path, body", [("/v1/completions", completion(**USAGE)), ("/v1/chat/completions", chat(**USAGE))])
def test_a_break_after_the_last_token_is_ended_by_the_proxy_with_the_usage_and_done(path, body):
    async def go():
        want = await unbroken(path, body)
        status, got, decode, metrics = await broken(path, body, Breaks("before_done"))
        assert status == 200 and got == want, (events(got), events(want))
        assert not any(isinstance(b.get("prompt"), list) for fake in decode for b in fake.bodies)  # no continuation
        assert 'yrpd_proxy_migrations_total{outcome="ended by the proxy"} 1' in metrics
    run(go())


def test_a_client_that_asked_for_token_ids_gets_every_one_once_across_the_break():
    async def go():
        body = completion(return_token_ids=True)
        want = await unbroken("/v1/completions", body)
        status, got, _, _ = await broken("/v1/completions", body, Breaks("between", after=5))
        assert status == 200 and got == want
        choices = [json.loads(e)["choices"][0] for e in events(got)[:-1]]
        prompt_ids = toy_tokens(PROMPT)
        assert [c["prompt_token_ids"] for c in choices] == [prompt_ids] + [None] * (N - 1)
        assert [t for c in choices for t in c["token_ids"]] == toy_answer(prompt_ids, N)
    run(go())


@pytest.mark.parametrize("kind, detokenize", [("between", 200), ("between", 500), ("merged", 200)])
@pytest.mark.parametrize("path, body", [("/v1/completions", completion(**USAGE)), ("/v1/chat/completions", chat(**USAGE))])
def test_a_break_right_after_a_token_whose_text_was_held_back_goes_on_with_that_token_made_again(kind, path, body,
                                                                                                  detokenize):
    # "between": the held token came in an event of its own, with no text; "merged": in one event with the token
    # before it (whose text it carries), which the proxy tells by asking an instance's /detokenize (what the text
    # decodes to); where /detokenize fails (500) the events still tell the first (the second is not claimed then)
    prompt = toy_chat_prompt(MESSAGES) if path == resume.CHAT else toy_tokens(PROMPT)
    ids = toy_answer(prompt, N)
    h = next(k for k in range(1, N - 1) if toy_held(ids[k]) and not toy_held(ids[k - 1]))

    async def go():
        want = await unbroken(path, body, held=True)
        assert HELD in want.decode()
        status, got, decode, _ = await broken(path, body, Breaks(kind, after=h + 1), held=True,
                                              detokenize=detokenize)
        assert status == 200
        if kind == "merged":  # the merged event is the client's own: the text is the unbroken run's
            assert answer_text(got) == answer_text(want) and events(got)[-1] == "[DONE]", events(got)
        else:  # the held token's event once, though the continuation sent it again
            assert got == want, (events(got), events(want))
        _, sent = continuation_of(decode)
        assert sent["prompt"] == prompt + ids[:h] and sent["max_tokens"] == N - h  # the held one made again
        asked = [tokens for fake in decode for tokens in fake.detokenized]
        assert asked == ([prompt, prompt + ids[:h + 1], prompt + ids[:h]] if detokenize == 200 else [prompt])
    run(go())


def _sse(d: dict) -> bytes:
    return b"data: " + json.dumps(d).encode() + b"\n\n"


def _event(text: str, ids: list[int], first: bool = False, chat_event: bool = False) -> bytes:
    """One event of a stream whose prompt's ids are [1, 2], as vLLM sends it with `return_token_ids`."""
    choice = {"index": 0, "delta": {"content": text}} if chat_event else {"index": 0, "text": text}
    choice["token_ids"] = ids
    if first and not chat_event:
        choice["prompt_token_ids"] = [1, 2]
    head = {"prompt_token_ids": [1, 2]} if first and chat_event else {}
    return _sse({"id": "x", "created": 1, "model": "tiny", **head, "choices": [choice]})


@pytest.mark.parametrize("chat_path", [False, True])
@pytest.mark.parametrize("show_ids", [False, True])
def test_tokens_whose_text_was_held_back_at_a_break_are_made_again_by_the_continuation_not_put_in_its_prompt(
        chat_path, show_ids):
    # vLLM sends a token that ends inside a UTF-8 character with no text, and the character with the next token;
    # tests/connector/test_continuation_vllm.py has the real instance's side of it
    path = resume.CHAT if chat_path else resume.COMPLETIONS
    body = (chat if chat_path else completion)(**({"return_token_ids": True} if show_ids else {}))
    st = resume.Stream(path, body)
    sent = [st.event(_event("a", [5], True, chat_path)), st.event(_event("", [6], chat_event=chat_path))]
    assert st.ids == [5, 6] and not st.limit_reached()
    cont_path, cont = st.continuation()
    assert cont_path == resume.COMPLETIONS and cont["prompt"] == [1, 2, 5] and cont["max_tokens"] == N - 1
    st.begin_continuation()
    sent.append(st.event(_event("\u00e9b", [6], first=True)))
    sent.append(st.event(_event("c", [7])))
    got = [json.loads(e[6:])["choices"][0] for e in sent]
    texts = [c["delta"]["content"] if chat_path else c["text"] for c in got]
    assert "".join(texts) == "a\u00e9bc" and st.ids == [5, 6, 7]
    if show_ids:  # each id once, though the continuation sent the held one again
        assert [t for c in got for t in c["token_ids"]] == [5, 6, 7]
    else:
        assert all(c["token_ids"] is None for c in got)


@pytest.mark.parametrize("path, body", [("/v1/completions", completion(stream=False)),
                                        ("/v1/chat/completions", chat(stream=False))])
def test_a_whole_answer_cut_off_mid_body_is_sent_again_and_answered_as_unbroken(path, body):
    async def go():
        want = await unbroken(path, body)
        status, got, decode, metrics = await broken(path, body, Breaks("body"))
        assert status == 200 and got == want
        assert sum(len(f.bodies) for f in decode) == 2  # the cut one, then once more
        assert 'yrpd_proxy_migrations_total{outcome="sent again"} 1' in metrics
    run(go())


def test_a_stream_that_keeps_breaking_ends_after_the_cap_with_one_error_event_and_the_tokens_sent_once():
    async def go():
        status, got, decode, metrics = await broken("/v1/completions", completion(max_tokens=40),
                                                    Breaks("error", after=2, times=99))
        assert status == 200
        *tokens, error, done = events(got)
        assert done == "[DONE]" and json.loads(error)["error"]["code"] == 502
        prompt_ids = toy_tokens(PROMPT)
        # each leg sent 2 tokens before it broke: the first and MAX_MIGRATIONS continuations
        texts = "".join(json.loads(e)["choices"][0]["text"] for e in tokens)
        assert texts == "".join(map(toy_text, toy_answer(prompt_ids, 40)[:2 * (MAX_MIGRATIONS + 1)]))
        assert f'yrpd_proxy_migrations_total{{outcome="carried over"}} {MAX_MIGRATIONS}' in metrics
        assert 'yrpd_proxy_migrations_total{outcome="not carried over"} 1' in metrics
    run(go())


def test_a_stream_asking_for_several_answers_is_not_carried_over_and_its_instances_are_not_asked_for_ids():
    async def go():
        status, got, decode, metrics = await broken("/v1/completions", completion(n=2), Breaks("between", after=2))
        assert status == 200
        assert json.loads(events(got)[-2])["error"]["code"] == 502  # as before migration: an error event
        assert not any("return_token_ids" in b for fake in decode for b in fake.bodies)
        assert 'yrpd_proxy_migrations_total{outcome="not carried over"} 1' in metrics
    run(go())


def test_with_no_other_decode_instance_the_stream_goes_on_on_the_prefill_instance_alone():
    """1 prefill + 1 decode, decode breaks: PD degrades for the rest of the answer, which the prefill instance
    generates from the continuation."""
    async def go():
        body = completion(**USAGE)
        want = await unbroken("/v1/completions", body)
        async with running(prefill=1, decode=1, toy=True) as s:
            s.decode[0].breaks = Breaks("between", after=3)
            status, got = await ask(s, "/v1/completions", body)
            assert status == 200 and got == want
            [prefill] = s.prefill
            assert isinstance(prefill.bodies[-1]["prompt"], list) and prefill.bodies[-1]["stream"]  # it generated
            assert 'yrpd_proxy_degraded_answers_total{how="prefill alone"} 1' in await s.metrics()
    run(go())


def test_with_no_instance_left_to_go_on_the_broken_stream_ends_with_an_error_event():
    """Control of the cases above: the break is the same, but the only other instance is down by then."""
    async def go():
        async with running(prefill=1, decode=1, toy=True, probe_interval=0.05) as s:
            [prefill], [decode] = s.prefill, s.decode
            decode.breaks = Breaks("between", after=3)
            decode.gate.clear()  # the decode leg waits until prefill is out of rotation
            asked = asyncio.ensure_future(ask(s, "/v1/completions", completion()))
            await decode.received.wait()
            prefill.health_status = 500
            await until(lambda: _down(s, prefill))
            decode.gate.set()
            status, data = await asked
            assert status == 200
            *tokens, error, done = events(data)
            assert len(tokens) == 3 and json.loads(error)["error"]["code"] == 502 and done == "[DONE]"
            assert 'yrpd_proxy_migrations_total{outcome="not carried over"} 1' in await s.metrics()
    run(go())


async def _down(s, fake) -> bool:
    return not (await s.instance(fake))["up"]


def test_the_request_log_line_of_a_migrated_stream_names_both_instances_and_the_warning_why(caplog):
    async def go():
        async with running(prefill=1, decode=2, toy=True) as s:
            breaks = Breaks("between", after=3)
            for fake in s.decode:
                fake.breaks = breaks
            status, _ = await ask(s, "/v1/completions", completion())
            assert status == 200
            return {f.url for f in s.decode}
    with caplog.at_level("INFO", logger="yrpd.proxy"):
        decode = run(go())
    [line] = [r.getMessage() for r in caplog.records if r.getMessage().startswith("POST /v1/completions 200")]
    went = re.search(r" decode=(\S+)>(\S+) ", line)
    assert "migrated=1" in line and went and set(went.groups()) == decode, line
    [warning] = [r.getMessage() for r in caplog.records if r.getMessage().endswith("; carried over")]
    assert went.group(1) in warning and "broke off the stream" in warning


# -- no stream hangs on a dead link


def test_a_stream_that_falls_silent_gets_heartbeat_comments_and_its_events_are_those_of_the_unbroken_stream():
    async def go():
        body = completion(**USAGE)
        want = await unbroken("/v1/completions", body)
        async with running(prefill=1, decode=1, toy=True, heartbeat_s=0.3) as s:
            s.decode[0].breaks = Breaks("pause", after=3, pause_s=1.2)
            status, got = await ask(s, "/v1/completions", body)
        assert status == 200
        beats = got.count(b": keep-alive\n\n")
        assert beats >= 2, got[:300]
        assert got.replace(b": keep-alive\n\n", b"") == want
    run(go())


def keepalive_timer_of(local_port: int, remote_port: int) -> str:
    """The timer field (`tr`) of the TCP socket local_port -> remote_port in /proc/net/tcp: 02 is keepalive."""
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == local_port and int(fields[2].split(":")[1], 16) == remote_port:
            return fields[5].split(":")[0]
    raise AssertionError(f"no socket {local_port} -> {remote_port}")


def test_the_proxys_client_connections_carry_tcp_keepalive_and_a_plain_listener_does_not():
    import socket

    async def go():
        async with running() as s:
            port = int(s.url.rsplit(":", 1)[1])
            client = socket.create_connection(("127.0.0.1", port))
            try:
                await asyncio.sleep(0.2)
                assert keepalive_timer_of(port, client.getsockname()[1]) == "02"
            finally:
                client.close()
        # the control: a listener without the proxy's options gives connections no keepalive timer
        plain = socket.socket()
        plain.bind(("127.0.0.1", 0))
        plain.listen(4)
        client = socket.create_connection(plain.getsockname())
        accepted, _ = plain.accept()
        try:
            assert keepalive_timer_of(plain.getsockname()[1], client.getsockname()[1]) == "00"
        finally:
            for sock in (accepted, client, plain):
                sock.close()
    run(go())


def test_a_request_routed_while_decode_was_up_that_finds_none_when_sent_goes_to_prefill_alone():
    """The race of a decode instance taken out between routing and sending: not a 503, the request is routed again."""
    async def go():
        async with running(prefill=1, decode=1, toy=True, probe_interval=0.05) as s:
            [prefill], [decode] = s.prefill, s.decode
            prefill.gate.clear()  # the prefill leg waits; meanwhile the only decode instance goes out of rotation
            asked = asyncio.ensure_future(ask(s, "/v1/completions", completion()))
            await prefill.received.wait()
            decode.health_status = 500
            await until(lambda: _down(s, decode))
            prefill.gate.set()
            status, data = await asked
            assert status == 200 and "error" not in data.decode() and events(data)[-1] == "[DONE]", data[:300]
            assert 'yrpd_proxy_migrations_total{outcome="sent again"} 1' in await s.metrics()
            assert decode.bodies == []
    run(go())


@pytest.mark.parametrize("path, body, why", [
    ("/v1/completions", {"prompt": "x", "n": 2}, "several answers"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, "several answers"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "several prompts"),
    ("/v1/completions", {"prompt": "x", "echo": True}, "echoes the prompt"),
    ("/v1/completions", {"prompt": "x", "guided_json": {"type": "object"}}, "guided_json"),
    ("/v1/chat/completions", {"messages": [], "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"messages": [], "tools": [{"type": "function"}]}, "tool calls"),
    ("/v1/chat/completions", {"messages": [], "logprobs": True}, "log-probabilities"),
])
def test_what_a_continuation_cannot_express_is_named_and_its_control_can_go_on(path, body, why):
    from yrpd.proxy.resume import not_resumable

    assert why in not_resumable(path, body)
    # the control: the same request without the field goes on
    plain = {k: v for k, v in body.items() if k in ("prompt", "messages")}
    if plain.get("prompt") == ["a", "b"]:
        plain["prompt"] = [101, 102]  # one prompt by token ids
    assert not_resumable(path, plain) is None
    assert not_resumable(path, {**plain, "tools": [{"type": "function"}], "tool_choice": "none"}) is None


@pytest.mark.parametrize("show_ids", [False, True])
@pytest.mark.parametrize("first_sends", [False, True])
def test_a_second_break_before_the_held_tokens_came_again_still_gives_the_client_each_event_once(first_sends, show_ids):
    # a 3-byte character: 6 and 8 end inside it, 9 completes it. The first continuation breaks off before it sent
    # anything (first_sends False) or after making 6 again and sending 8, still with no text (True)
    st = resume.Stream(resume.COMPLETIONS, completion(**({"return_token_ids": True} if show_ids else {})))
    out = [st.event(_event("a", [5], first=True)), st.event(_event("", [6]))]
    st.begin_continuation()
    if first_sends:
        out += [st.event(_event("", [6], first=True)), st.event(_event("", [8]))]
    assert st.continuation()[1]["prompt"] == [1, 2, 5]
    st.begin_continuation()
    out += [st.event(_event("", [6], first=True)), st.event(_event("", [8])), st.event(_event("\u20acb", [9]))]
    got = [json.loads(e[6:])["choices"][0] for e in out if e]
    assert "".join(c["text"] for c in got) == "a\u20acb" and st.ids == [5, 6, 8, 9]
    assert len(got) == 4  # one event each of 5, 6, 8 and 9: none of the remade ones again
    assert [t for c in got for t in c["token_ids"]] == [5, 6, 8, 9] if show_ids else \
        all(c["token_ids"] is None for c in got)
