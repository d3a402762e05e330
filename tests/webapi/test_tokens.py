"""vLLM's POST /tokenize and /detokenize: the served model's tokenizer, as the engine encodes prompts."""

from __future__ import annotations

from batching.tokenizer import load_tokenizer

CHAT = [{"role": "user", "content": "What comes after Tuesday?"}]


def test_tokenize_a_prompt_as_the_engine_encodes_it(client, auth, settings):
    tokenizer = load_tokenizer(settings.model)
    r = client.post("/tokenize", json={"model": settings.model, "prompt": "Hello world"}, headers=auth())
    assert r.status_code == 200, r.json
    assert r.json["tokens"] == tokenizer.encode("Hello world") and tokenizer.encode("Hello world")[0] == 1
    assert r.json["count"] == len(r.json["tokens"]) and r.json["max_model_len"] == settings.max_model_len
    assert r.json["token_strs"] is None
    bare = client.post(
        "/tokenize",
        json={"prompt": "Hello world", "add_special_tokens": False, "return_token_strs": True},
        headers=auth(),
    ).json
    assert bare["tokens"] == r.json["tokens"][1:]
    assert bare["token_strs"] == tokenizer.convert_ids_to_tokens(bare["tokens"])


def test_tokenize_messages_with_the_chat_template(client, auth, settings):
    tokenizer = load_tokenizer(settings.model)
    want = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=True)["input_ids"]
    r = client.post("/tokenize", json={"messages": CHAT}, headers=auth())
    assert r.status_code == 200 and r.json["tokens"] == want


def test_detokenize_gives_the_text_back(client, auth, settings):
    tokenizer = load_tokenizer(settings.model)
    ids = tokenizer.encode("Once upon a time")
    r = client.post("/detokenize", json={"model": settings.model, "tokens": ids}, headers=auth())
    assert r.status_code == 200 and r.json == {"prompt": tokenizer.decode(ids)}


def test_tokenizer_info(client, auth, settings):
    tokenizer = load_tokenizer(settings.model)
    r = client.get("/tokenizer_info", headers=auth())
    assert r.status_code == 200
    assert (r.json["eos_token"], r.json["bos_token"]) == (tokenizer.eos_token, tokenizer.bos_token)
    assert r.json["chat_template"] == tokenizer.chat_template
    assert r.json["model_max_length"] == settings.max_model_len


def test_bad_token_requests_name_the_field(client, auth):
    cases = [
        ("/tokenize", {"prompt": "x", "messages": CHAT}, None, "exactly one of"),
        ("/tokenize", {"messages": CHAT, "add_special_tokens": True}, None, "add_special_tokens"),
        ("/tokenize", {"prompt": "x", "model": "gpt-4"}, "model", "does not exist"),
        ("/detokenize", {"tokens": [10**6]}, None, "tokens: token ids must be below"),
        ("/detokenize", {"tokens": "1 2"}, "tokens", "expected an array"),
    ]
    for path, body, field, text in cases:
        r = client.post(path, json=body, headers=auth())
        assert r.status_code in (404, 422), (body, r.json)
        assert text in r.json["error"]["message"], (body, r.json)
        if field:
            assert r.json["error"]["message"].startswith(field), r.json
    assert client.post("/tokenize", json={"prompt": "x"}).status_code == 401
