"""Request migration: a streamed answer whose instance breaks off goes on on another instance, and the client reads
one unbroken stream.

The leg that streams the answer is asked for its token ids (vLLM's `return_token_ids`: the prompt's with the first
event, each event's own with it). `Stream` reads every whole SSE event before it goes to the client, keeps those ids
and takes out what the client did not ask for. When the leg breaks (its connection lost, its instance declared down,
an error event in the stream, its end before the last token) `Stream.continuation()` is the request that goes on: to
`/v1/completions`, the prompt's ids followed by the ids already sent (nothing is tokenized again), `max_tokens` less
what was sent; the last ids whose text vLLM still held back (an unfinished UTF-8 character) are left for the
continuation to make again. Its events are put into the first stream's frame (id, created, model; for a chat request
each text becomes a chat delta) so the client sees no error event, no token twice or missing, one `[DONE]`, and usage
over the whole answer.

What stays different from an unbroken run: the carried tokens' KV is computed in one prefill pass, not token by
token, so a greedy answer can take the other branch where two tokens were within rounding of each other (docs/
reliability.md has the measurement); with sampling and a `seed` the part after the break is a fresh sample; a `stop`
string split by the break is not seen. A request the continuation cannot express (`not_resumable`) ends with an error
event as before.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

#: how often one request may be carried over; then its stream ends with an error event
MAX_MIGRATIONS = 3
#: the most tokens whose text vLLM may hold back at once: a UTF-8 character is at most 4 bytes, a byte-level token one
HELD_MAX = 4

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"

#: what a chat request's continuation on /v1/completions keeps: the sampling and output settings both endpoints take
_CARRIED_FROM_CHAT = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
                      "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                      "bad_words", "include_stop_str_in_output", "skip_special_tokens",
                      "spaces_between_special_tokens", "stream_options", "user", "priority", "cache_salt",
                      "truncate_prompt_tokens", "allowed_token_ids", "vllm_xargs", "length_penalty")
#: a completion request's fields its continuation drops: the prompt is replaced, the echo was sent already
_DROPPED_FROM_COMPLETION = ("prompt", "echo", "prompt_logprobs", "kv_transfer_params", "max_tokens", "min_tokens",
                            "return_token_ids")
#: fields whose output the instance shapes from the whole answer: a continuation would start them over
_STRUCTURED = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
               "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern")


class Broken(Exception):
    """The stream's instance ended it with an error event (an engine that died answers so)."""


def not_resumable(path: str, body: dict) -> str | None:
    """Why a streamed request of `path` cannot go on on another instance, None when it can."""
    if body.get("n") not in (None, 1) or body.get("best_of") not in (None, 1):
        return "it asks for several answers (n)"
    if body.get("echo"):
        return "it echoes the prompt, whose ids vLLM then sends among the answer's"
    for key in _STRUCTURED:
        if body.get(key) not in (None, {}):
            return f"its output follows {key}, which a continuation would start over"
    if path == CHAT:
        if body.get("tools") and body.get("tool_choice") != "none":
            return "the instance parses its tool calls from the whole answer"
        if body.get("logprobs") or body.get("top_logprobs"):
            return "chat log-probabilities are not carried over"
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        return "it holds several prompts"
    return None


def _count(value: object) -> int | None:
    """A token count a request gives (an int, not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class Stream:
    """What went to the client of one streamed answer, and how it goes on after a break."""

    def __init__(self, path: str, body: dict):
        self.chat = path == CHAT
        self.body = body
        self.why_not = not_resumable(path, body)
        self.show_ids = bool(body.get("return_token_ids"))  # the client's own wish: its events keep the ids
        self.prompt_ids: list[int] | None = None
        self.ids: list[int] = []  # the answer's token ids the client was sent
        # How many of `ids` a continuation's prompt takes. vLLM holds back the text of a token that ends inside a
        # UTF-8 character until the token that completes it, and vLLM 0.32 (tokenizers 0.23) primes a request's
        # detokenizer with its prompt: a prompt that ends inside a character makes its first event carry the whole
        # prompt's text. The prompt ends where the text is whole, the continuation makes the rest again. The events
        # tell it for a token that came alone with no text; `settle` finds it in general.
        self.shown = 0
        self.text: list[str] | None = []  # the answer's text as the client was sent it; None: not all of it text
        self.taken_back: list[int] = []  # ids the client had events of that the continuation makes again
        self.finish: str | None = None  # the finish_reason the client was sent
        self.usage_sent = False
        self.done = False  # [DONE] went out
        self.started = False  # an event went out
        self.frame: tuple | None = None  # (id, created, model) of the first event: every later one is put in it
        self.continued = False  # the events come from a continuation
        self.migrations = 0
        self.token_events = 0  # events that carried a token (the time between tokens is measured over them)

    def leg_body(self) -> dict:
        """The body of the leg that streams the answer: the client's, asking for the token ids where it may go on."""
        return self.body if self.why_not else {**self.body, "return_token_ids": True}

    @property
    def complete(self) -> bool:
        """The last token went out: what a break still owes the client is the usage and [DONE] (`ending`)."""
        return self.finish is not None

    def event(self, raw: bytes) -> bytes:
        """One whole SSE event from the instance (ending in a blank line) in, what goes to the client out (b"" for
        nothing). Broken for an error event."""
        lines = raw.split(b"\n")
        data = [ln[6:] for ln in lines if ln.startswith(b"data: ")]
        if len(data) != 1:  # a comment or a shape vLLM does not send: passed on as it is
            return self._out(raw)
        payload = data[0].strip()
        if payload == b"[DONE]":
            self.done = True
            return self._out(raw)
        try:
            d = json.loads(payload)
        except ValueError:
            return self._out(raw)
        if not isinstance(d, dict):
            return self._out(raw)
        if "error" in d and not d.get("choices"):
            err = d["error"]
            raise Broken(err.get("message", str(err)) if isinstance(err, dict) else str(err))
        changed = self._take(d)
        if changed is None:
            return b""
        return self._out(raw if not changed else b"data: " + _dumps(d) + b"\n\n")

    def _out(self, raw: bytes) -> bytes:
        self.started = self.started or bool(raw)
        return raw

    def _take(self, d: dict) -> bool | None:
        """Record what the event `d` tells and make it the client's; True when `d` was changed, None when the client
        gets nothing of it."""
        changed = self.continued
        if self.frame is None:
            self.frame = (d.get("id"), d.get("created"), d.get("model"))
        if self.continued:  # the first stream's frame
            d["id"], d["created"], d["model"] = self.frame
        # the prompt's ids: a chat stream's first event has them, a completion stream's first choice
        if self.chat and "prompt_token_ids" in d:
            changed |= self._prompt_ids(d)
        choices = d.get("choices") if isinstance(d.get("choices"), list) else []
        for choice in (c for c in choices if isinstance(c, dict)):
            if not self.chat and "prompt_token_ids" in choice:
                changed |= self._prompt_ids(choice)
            ids = choice.get("token_ids") or []
            self.ids.extend(ids)
            text, reasoning = _text(choice)
            if text or reasoning:
                self.shown = len(self.ids)
            if reasoning:
                self.text = None  # the answer's ids decode to more than the content the client reads
            elif text and self.text is not None:
                self.text.append(text)
            if ids and self.taken_back:  # the client had events of these from the leg that broke, unless made otherwise
                same = 0
                while same < min(len(ids), len(self.taken_back)) and ids[same] == self.taken_back[same]:
                    same += 1
                self.taken_back = self.taken_back[same:] if same == len(ids) else []
                if same == len(ids) and not (text or reasoning or choice.get("finish_reason")) and len(choices) == 1 \
                        and not d.get("usage"):
                    return None  # the client had this event already
                if self.show_ids:
                    choice["token_ids"] = ids[same:]
                    changed = True
            self.token_events += bool(text or reasoning)
            if not self.show_ids and choice.get("token_ids") is not None:
                choice["token_ids"] = None  # as the instance sends them to a client that did not ask
                changed = True
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        if self.chat and self.continued:
            d["object"] = "chat.completion.chunk"
            d["choices"] = [_as_chat(c, self.show_ids) for c in choices if isinstance(c, dict)]
        usage = d.get("usage")
        if isinstance(usage, dict):
            if self.continued and self.prompt_ids is not None:  # the whole answer's, not the continuation's
                usage.update(self._usage())
            if not choices:
                self.usage_sent = True
        return changed

    def _prompt_ids(self, holder: dict) -> bool:
        """Take the prompt's ids from `holder` (the first stream's; a continuation's are its own prompt) and leave
        them to the client only where it asked for them; True when `holder` changed."""
        ids = holder["prompt_token_ids"]
        if not self.continued and ids is not None and self.prompt_ids is None:
            self.prompt_ids = list(ids)
        if ids is None or (self.show_ids and not self.continued):
            return False
        holder["prompt_token_ids"] = None  # as the instance sends them to a client that did not ask
        return True

    async def settle(self, decode: Callable[[list[int]], Awaitable[str]]) -> None:
        """Where the continuation's prompt ends (`shown`), from the text: the most ids, looking back over the last
        HELD_MAX, that decoded after the prompt's ids (`decode`: an instance's /detokenize, the prompt giving the
        first token's leading space as the stream had it) make exactly the prompt's text and what the client has.
        An event of several tokens can end with a held one, which the events cannot tell. Left as the events tell
        where none fits (a detokenizer whose whole decode differs from its stream's) or the client's text is not
        all of the answer's."""
        if self.text is None or self.prompt_ids is None or not self.ids:
            return
        had = await decode(self.prompt_ids) + "".join(self.text)
        for m in range(len(self.ids), max(-1, len(self.ids) - HELD_MAX - 1), -1):
            if await decode([*self.prompt_ids, *self.ids[:m]]) == had:
                self.shown = m
                return

    def continuation(self) -> tuple[str, dict] | None:
        """(path, body) of the request that goes on with the answer; None where it cannot (the prompt's ids never
        came: an instance that does not give them)."""
        if self.prompt_ids is None:
            return None
        sent = self.shown
        body = self.body
        if self.chat:
            cont = {k: body[k] for k in _CARRIED_FROM_CHAT if k in body}
        else:
            cont = {k: v for k, v in body.items() if k not in _DROPPED_FROM_COMPLETION}
        if self._limit is not None:
            cont["max_tokens"] = max(1, self._limit - sent)
        least = _count(body.get("min_tokens"))
        if least is not None and least > sent:
            cont["min_tokens"] = least - sent
        cont.update(prompt=[*self.prompt_ids, *self.ids[:sent]], stream=True, return_token_ids=True)
        return COMPLETIONS, cont

    def begin_continuation(self) -> None:
        """The continuation goes out: the ids whose text never came are the continuation's to make again."""
        self.continued = True
        self.migrations += 1
        self.taken_back = self.ids[self.shown:] + self.taken_back  # and what an earlier one had still to make
        del self.ids[self.shown:]

    @property
    def _limit(self) -> int | None:
        """The most tokens the answer may have, where the request says."""
        body = self.body
        limit = body.get("max_completion_tokens", body.get("max_tokens")) if self.chat else body.get("max_tokens")
        return _count(limit)

    def limit_reached(self) -> bool:
        """The answer has every token it may have, with its text, though its last event never came (a break right
        after it)."""
        return self._limit is not None and self.shown >= self._limit

    def _usage(self) -> dict:
        """The whole answer's usage, in vLLM's order."""
        return {"prompt_tokens": len(self.prompt_ids), "total_tokens": len(self.prompt_ids) + len(self.ids),
                "completion_tokens": len(self.ids)}

    def ending(self) -> bytes:
        """What a stream whose last token went out still owes its client after a break: the usage event where it
        was asked for and did not come, and [DONE]."""
        out = b""
        if self.finish is None:  # every token came, not the event that says so
            self.finish = "length"
            choice = {"index": 0, "delta": {}} if self.chat else {"index": 0, "text": ""}
            out += self._framed({"choices": [{**choice, "logprobs": None, "finish_reason": "length"}]})
        wants_usage = isinstance(self.body.get("stream_options"), dict) and \
            self.body["stream_options"].get("include_usage")
        if wants_usage and not self.usage_sent and self.prompt_ids is not None:
            self.usage_sent = True
            out += self._framed({"choices": [], "usage": self._usage()})
        if not self.done:
            self.done = True
            out += b"data: [DONE]\n\n"
        return out

    def _framed(self, d: dict) -> bytes:
        ident, created, model = self.frame or (None, None, self.body.get("model"))
        head = {"id": ident, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": created, "model": model}
        return b"data: " + _dumps({**head, **d}) + b"\n\n"


def _text(choice: dict) -> tuple[str, bool]:
    """The answer's text a choice brought (a completion's text, a chat delta's content: a chat stream's continuation
    is a completion), and whether it brought reasoning (a chat delta's, text of the answer's tokens kept apart from
    the content)."""
    delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
    return (choice.get("text") or delta.get("content") or "",
            bool(delta.get("reasoning_content") or delta.get("reasoning")))


def _as_chat(choice: dict, show_ids: bool) -> dict:
    """A continuation's completion choice as the chat delta the client's stream is made of."""
    out = {"index": choice.get("index", 0), "delta": {"content": choice.get("text", "")}, "logprobs": None,
           "finish_reason": choice.get("finish_reason")}
    if choice.get("finish_reason"):
        out["stop_reason"] = choice.get("stop_reason")
    out["token_ids"] = choice.get("token_ids") if show_ids else None
    return out


def _dumps(d: dict) -> bytes:
    # vLLM's own events are compact JSON with the text as UTF-8
    return json.dumps(d, ensure_ascii=False, separators=(",", ":")).encode()
